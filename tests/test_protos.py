"""The committed stubs match the protos, import cleanly, and mirror the Python wire types."""

from __future__ import annotations

import dataclasses
import pickle
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from services.common.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parent.parent
CODEGEN = REPO / "protos" / "codegen.py"
PB_DIR = REPO / "services" / "common" / "pb"


def _codegen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CODEGEN), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_committed_stubs_are_up_to_date() -> None:
    result = _codegen("--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_reports_stale_missing_and_extra_files(tmp_path: Path) -> None:
    out = tmp_path / "pb"
    shutil.copytree(PB_DIR, out, ignore=shutil.ignore_patterns("__pycache__"))
    (out / "decode_pb2.py").write_text((out / "decode_pb2.py").read_text() + "\n# edited\n")
    (out / "prefill_pb2.pyi").unlink()
    (out / "old_pb2.py").write_text("")
    result = _codegen("--check", "--out-dir", str(out))
    assert result.returncode == 1
    report = result.stdout + result.stderr
    assert "stale: " in report and "decode_pb2.py" in report
    assert "missing: " in report and "prefill_pb2.pyi" in report
    assert "extra " in report and "old_pb2.py" in report
    assert "tokenizer_pb2.py" not in report


def test_codegen_writes_what_check_expects(tmp_path: Path) -> None:
    out = tmp_path / "pb"
    assert _codegen("--out-dir", str(out)).returncode == 0
    assert _codegen("--check", "--out-dir", str(out)).returncode == 0
    text = (out / "decode_pb2_grpc.py").read_text()
    assert "from services.common.pb import decode_pb2" in text
    assert "from tandem.v1" not in text


def test_stubs_import_with_rewritten_module_names() -> None:
    from services.common.pb import (
        common_pb2,
        decode_pb2,
        decode_pb2_grpc,
        prefill_pb2,
        prefill_pb2_grpc,
        tokenizer_pb2,
        tokenizer_pb2_grpc,
    )

    assert common_pb2.DESCRIPTOR.name == "tandem/v1/common.proto"
    assert common_pb2.DESCRIPTOR.package == "tandem.v1"
    assert decode_pb2.KVChunk.__module__ == "services.common.pb.decode_pb2"
    for stub in (tokenizer_pb2_grpc.TokenizerStub, prefill_pb2_grpc.PrefillStub,
                 decode_pb2_grpc.DecodeStub):  # fmt: skip
        assert callable(stub)
    chunk = decode_pb2.KVChunk(first_block=2, num_blocks=1, data=b"kv", offset=7)
    assert pickle.loads(pickle.dumps(chunk)) == chunk
    params = prefill_pb2.PrefillRequest.DESCRIPTOR.fields_by_name["params"]
    assert params.message_type.full_name == "tandem.v1.SamplingParams"


def _methods(module: object, service: str) -> dict[str, tuple[str, str, bool, bool]]:
    desc = module.DESCRIPTOR.services_by_name[service]  # type: ignore[attr-defined]
    return {
        m.name: (
            m.input_type.name,
            m.output_type.name,
            m.client_streaming,
            m.server_streaming,
        )
        for m in desc.methods
    }


def test_services_and_rpcs() -> None:
    from services.common.pb import decode_pb2, prefill_pb2, prefix_cache_pb2, tokenizer_pb2

    assert _methods(prefix_cache_pb2, "PrefixCache") == {
        "Watch": ("WatchPrefixCacheRequest", "PrefixCacheUpdate", False, True),
    }

    assert _methods(tokenizer_pb2, "Tokenizer") == {
        "Tokenize": ("TokenizeRequest", "TokenizeResponse", False, False),
        "Detokenize": ("DetokenizeRequest", "DetokenizeResponse", True, True),
        "GetModelInfo": ("ModelInfoRequest", "ModelInfo", False, False),
    }
    assert _methods(prefill_pb2, "Prefill") == {
        "Prefill": ("PrefillRequest", "PrefillResponse", False, False),
        "Abort": ("AbortRequest", "AbortResponse", False, False),
        "GetStats": ("StatsRequest", "WorkerStats", False, False),
        "Embed": ("EmbedRequest", "EmbedResponse", False, False),
    }
    assert _methods(decode_pb2, "Decode") == {
        "Reserve": ("ReserveRequest", "ReserveResponse", False, False),
        "TransferKV": ("KVTransferMessage", "KVTransferAck", True, False),
        "Generate": ("GenerateRequest", "GenerateResponse", False, True),
        "Abort": ("AbortRequest", "AbortResponse", False, False),
        "GetStats": ("StatsRequest", "WorkerStats", False, False),
        "KVStore": ("KVStoreRequest", "KVStoreResponse", False, False),
    }
    assert decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name == "tandem.v1.Decode"


def test_sampling_params_proto_mirrors_the_dataclass() -> None:
    from services.common.pb import common_pb2

    proto_fields = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    assert set(proto_fields) == {f.name for f in dataclasses.fields(SamplingParams)}
    with_presence = {name for name, f in proto_fields.items() if f.has_presence}
    assert with_presence == {"seed", "logprobs", "prompt_logprobs"}

    msg = common_pb2.SamplingParams(temperature=0.7, top_k=-1, stop=["\n\n"], max_tokens=5)
    assert not msg.HasField("seed") and not msg.HasField("logprobs")
    msg.seed = -(2**63)
    msg.logprobs = 0
    assert msg.HasField("seed") and msg.HasField("logprobs") and msg.logprobs == 0
    back = common_pb2.SamplingParams.FromString(msg.SerializeToString())
    assert back.temperature == 0.7 and back.top_k == -1 and list(back.stop) == ["\n\n"]


def test_oneofs_and_optional_messages() -> None:
    from services.common.pb import common_pb2, decode_pb2, prefill_pb2, tokenizer_pb2

    req = tokenizer_pb2.TokenizeRequest(
        chat=tokenizer_pb2.ChatMessages(
            messages=[common_pb2.ChatMessage(role="user", content="hi")]
        ),
        add_generation_prompt=True,
    )
    assert req.WhichOneof("input") == "chat"
    req.text = "raw"
    assert req.WhichOneof("input") == "text"

    first = tokenizer_pb2.DetokenizeRequest(
        config=tokenizer_pb2.DetokenizeConfig(stop=["END"], prompt_token_ids=[1, 2])
    )
    assert first.WhichOneof("kind") == "config"
    assert tokenizer_pb2.DetokenizeRequest(
        ids=tokenizer_pb2.TokenIds(token_ids=[5])
    ).WhichOneof("kind") == "ids"

    info = tokenizer_pb2.ModelInfo(eos_token_ids=[2], special_tokens={"<|im_end|>": 2})
    assert not info.HasField("bos_token_id")
    assert info.special_tokens["<|im_end|>"] == 2

    resp = prefill_pb2.PrefillResponse(first_token_id=3)
    assert not resp.HasField("first_logprob")
    resp.first_logprob.CopyFrom(
        common_pb2.TokenLogprob(
            token_id=3, logprob=-0.5, top=[common_pb2.TopLogprob(token_id=3, logprob=-0.5)]
        )
    )
    assert resp.HasField("first_logprob")

    data = bytes(range(256)) * 4
    chunk = decode_pb2.KVChunk(data=data, crc32=zlib.crc32(data))
    msg = decode_pb2.KVTransferMessage(chunk=chunk)
    back = decode_pb2.KVTransferMessage.FromString(msg.SerializeToString())
    assert back.WhichOneof("kind") == "chunk"
    assert zlib.crc32(back.chunk.data) == back.chunk.crc32
    assert decode_pb2.KVChunk.DESCRIPTOR.fields_by_name["crc32"].type == (
        decode_pb2.KVChunk.DESCRIPTOR.fields_by_name["crc32"].TYPE_FIXED32
    )


@pytest.mark.parametrize("proto", ["common", "tokenizer", "prefill", "decode"])
def test_protos_are_documented_and_versioned(proto: str) -> None:
    text = (REPO / "protos" / "tandem" / "v1" / f"{proto}.proto").read_text()
    assert "package tandem.v1;" in text
    assert text.startswith("//"), "each proto opens with a comment saying what it is"
