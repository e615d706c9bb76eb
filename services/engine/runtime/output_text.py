"""A worker's one owner of output text: detokenization and stop strings, outside the engine.

The engine core works in token ids only: it samples, applies EOS / stop-token / length limits,
and returns :class:`~services.engine.core.engine.RequestOutput` deltas. This module turns a
request's new ids into text deltas with the tokenizer service's
:class:`~services.tokenizer.detokenizer.IncrementalDetokenizer` (UTF-8 safe, stop strings held
back) as each output leaves the engine, on the engine thread (``EngineLoop._deliver``) or in
:meth:`LLMEngine.generate <services.engine.core.engine.LLMEngine.generate>`. When a stop string
completes it finishes the request in the engine at once (``engine.finish``), before the next
step could schedule it, so no token is generated past the stop (the split vLLM makes between its
engine core and its output processor).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.sampling_params import SamplingParams
from services.engine.core.engine import LLMEngine, RequestOutput
from services.tokenizer.detokenizer import Decoder, IncrementalDetokenizer


class OutputText:
    """Text deltas for every request started here; implements the engine's ``OutputFilter``."""

    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer
        self._streams: dict[str, IncrementalDetokenizer] = {}
        self._params: dict[str, SamplingParams] = {}

    def start(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        resume_output_ids: Sequence[int] = (),
    ) -> None:
        """Begin a request's text (its prompt ids are the decoding context). A migrated request's
        earlier outputs are pushed through first and their text dropped: the detokenizer is
        deterministic, so it ends in the state the first worker's had, text held back for a
        possible stop string included, and what comes next continues the client's text."""
        stream = IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            prompt_token_ids=list(prompt_token_ids),
        )
        for token in resume_output_ids:
            stream.push([token])
        self._streams[request_id] = stream
        self._params[request_id] = params

    def apply(self, out: RequestOutput, engine: LLMEngine) -> None:
        """Fill ``out.text``; a completed stop string finishes the request (reason "stop")."""
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        tokens = out.new_token_ids
        if out.finish_reason == "stop" and tokens and self._stops(out.request_id, tokens[-1], engine):
            tokens = tokens[:-1]  # as vLLM: the EOS / stop token is not part of the text
        for token in tokens:
            delta = stream.push([token])
            out.text += delta.text
            if delta.stopped:
                if not out.finished:  # an EOS or length limit on the same token wins
                    engine.finish(out.request_id, "stop")
                    out.finished, out.finish_reason = True, "stop"
                break
        if out.finished:
            if not stream.stopped:
                out.text += stream.flush()
            del self._streams[out.request_id]
            self._params.pop(out.request_id, None)

    def drop(self, request_id: str) -> None:
        """Forget a request that ended without a finished output (cancelled before any step)."""
        self._streams.pop(request_id, None)
        self._params.pop(request_id, None)

    def _stops(self, request_id: str, token: int, engine: LLMEngine) -> bool:
        """Whether ``token`` ended its request as a stop token (EOS or ``stop_token_ids``)."""
        params = self._params.get(request_id)
        if params is None:
            return False
        eos = token in engine.eos_token_ids and not params.ignore_eos
        return eos or token in params.stop_token_ids

    def __len__(self) -> int:
        return len(self._streams)
