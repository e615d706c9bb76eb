"""Conversions between Tandem's Python values and their protobuf messages (tandem.v1).

Torch-free, so the gateway can use it as well as the workers. Two value kinds cross the wire:

- :class:`~services.common.sampling_params.SamplingParams` <-> ``SamplingParams``: proto3 scalars
  have no "unset" state, so :func:`sampling_params_to_proto` always fills every field and
  :func:`sampling_params_from_proto` takes every field as sent (an all-zero message is *not* the
  dataclass defaults: its ``max_tokens`` 0 and ``top_p`` 0 fail validation, on purpose). Only
  ``seed`` and ``logprobs`` carry presence. Seeds at or above 2**63 travel as their
  two's-complement int64 and come back negative, which seeds a generator identically.
- token logprobs <-> ``TokenLogprob``: the engine's ``TokenLogprobs`` lives in the torch side
  (``services.engine.core.sampler``), so the reverse conversion takes the class to build as an
  argument instead of importing it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from services.common.errors import InvalidArgumentError
from services.common.pb import common_pb2
from services.common.sampling_params import SamplingParams

_INT64_MIN = -(2**63)
_INT64_SPAN = 2**64

T = TypeVar("T")


class LogprobsLike(Protocol):
    """What :func:`token_logprobs_to_proto` reads (the engine's ``TokenLogprobs`` fits)."""

    @property
    def token_id(self) -> int: ...
    @property
    def logprob(self) -> float: ...
    @property
    def top(self) -> tuple[tuple[int, float], ...]: ...
    @property
    def rank(self) -> int: ...


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Every field of ``params`` as a proto message (seed folded into int64)."""
    msg = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        n=params.n,
        skip_special_tokens=params.skip_special_tokens,
        grammar=params.grammar or "",
        cache_salt=params.cache_salt,
        logit_bias=dict(params.logit_bias),
        speculative=params.speculative,
    )
    if params.seed is not None:
        seed = params.seed
        if not _INT64_MIN <= seed < _INT64_SPAN:
            raise InvalidArgumentError("seed must fit in 64 bits", param="seed")
        msg.seed = seed - _INT64_SPAN if seed >= 2**63 else seed
    if params.logprobs is not None:
        if params.logprobs < 0:
            raise InvalidArgumentError("top_logprobs must be non-negative", param="top_logprobs")
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        if params.prompt_logprobs < 0:
            raise InvalidArgumentError("prompt_logprobs must be non-negative", param="prompt_logprobs")
        msg.prompt_logprobs = params.prompt_logprobs
    return msg


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """The dataclass for ``msg``, validated (InvalidArgumentError names the bad field)."""
    params = SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens,
        min_tokens=msg.min_tokens,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        n=msg.n,
        skip_special_tokens=msg.skip_special_tokens,
        grammar=msg.grammar or None,
        cache_salt=msg.cache_salt,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        speculative=msg.speculative,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )
    return params.validate()


def token_logprobs_to_proto(lp: LogprobsLike) -> common_pb2.TokenLogprob:
    """One chosen token's logprob and its top alternatives (most likely first)."""
    return common_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        rank=lp.rank,
    )


def token_logprobs_from_proto(
    msg: common_pb2.TokenLogprob,
    factory: Callable[[int, float, tuple[tuple[int, float], ...], int], T],
) -> T:
    """Rebuild a logprobs value with ``factory(token_id, logprob, top, rank)`` (rank 0: not
    computed).

    Pass the engine's ``TokenLogprobs`` class as ``factory`` on the torch side; the gateway can
    pass any constructor of its own.
    """
    top = tuple((int(t.token_id), float(t.logprob)) for t in msg.top)
    return factory(int(msg.token_id), float(msg.logprob), top, int(msg.rank))
