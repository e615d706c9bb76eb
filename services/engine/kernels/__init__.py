"""Optional Triton kernels. Imported lazily (only when a Triton backend is asked for), so that
CPU-only installs and the reference path never touch Triton. On CPU they run under Triton's
interpreter (``TRITON_INTERPRET=1``), which the tests use to check them against the torch path."""
