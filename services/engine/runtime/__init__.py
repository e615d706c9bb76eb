"""The worker runtime: the engine thread (``EngineLoop``) and its request plumbing, worker
stats, worker options and start-up shared by the prefill and decode services, and the
offline ``tandem generate`` command. Builds on ``services.engine.core``."""
