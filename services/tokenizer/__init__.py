"""The tokenizer library and service: text <-> token ids, torch-free.

- ``tokenizer.py``: :class:`Tokenizer` (encode, decode, chat template) loaded from a GGUF file or
  a Hugging Face folder; token ids equal transformers'.
- ``gguf_vocab.py``: rebuilds a ``tokenizers.Tokenizer`` from GGUF metadata.
- ``chat_template.py``: sandboxed Jinja rendering with transformers' semantics.
- ``detokenizer.py``: incremental, UTF-8-safe detokenization with stop strings.
- ``context_window.py``: the context-window policy of docs/request-lifecycle.md, step 3.
"""
