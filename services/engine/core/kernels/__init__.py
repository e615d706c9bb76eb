"""Native kernels. On CPU: C sources built at run time for the machine's instruction set
(``native_build``), each with a ``load_*`` function that returns ``None`` where it can't be built
(the caller keeps its PyTorch path) and each proving itself against PyTorch on the model's shapes
before it runs (``autotune``). Triton kernels (``paged_decode_attention``) are imported only when a
Triton backend is asked for, so CPU-only installs never touch Triton; on CPU the tests run them
under Triton's interpreter (``TRITON_INTERPRET=1``)."""
