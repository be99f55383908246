"""The ONNX wrappers of speech_tokenizer_v2.onnx / campplus.onnx, exercised on the seeded stand-ins."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from cosyvoice_triton.errors import AudioError, CheckpointError, CosyVoiceError
from cosyvoice_triton.frontend.speech_models import (
    CAMPPLUS_INPUTS,
    CAMPPLUS_OUTPUTS,
    SPEAKER_EMBED_DIM,
    SPEECH_TOKEN_VOCAB,
    TOKENIZER_INPUTS,
    TOKENIZER_OUTPUTS,
    SpeakerEncoder,
    SpeechTokenizer,
    speech_token_count,
)
from cosyvoice_triton.models.standins import (
    campplus_standin,
    speech_tokenizer_standin,
    write_campplus_standin,
    write_speech_tokenizer_standin,
)


def _mel(rng: np.random.Generator, lengths: list[int], pad_value: float = 0.0) -> np.ndarray:
    """Whisper-like log-mel batch [B, 128, T]: values in the real range, ``pad_value`` past each length."""
    out = np.full((len(lengths), 128, max(lengths)), pad_value, dtype=np.float32)
    for row, n in zip(out, lengths, strict=True):
        row[:, :n] = rng.uniform(-0.8, 1.2, (128, n))
    return out


def _fbank(rng: np.random.Generator, lengths: list[int], pad_value: float = 0.0) -> np.ndarray:
    out = np.full((len(lengths), max(lengths), 80), pad_value, dtype=np.float32)
    for row, n in zip(out, lengths, strict=True):
        row[:n] = rng.normal(0.0, 3.0, (n, 80)) + rng.normal(0.0, 2.0, 80)
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["batch1", "dynbatch"])
def tokenizer(request, tmp_path_factory) -> SpeechTokenizer:
    path = tmp_path_factory.mktemp("tok") / "speech_tokenizer_v2.onnx"
    write_speech_tokenizer_standin(path, seed=0, dynamic_batch=request.param)
    return SpeechTokenizer(path)


@pytest.fixture(scope="module", params=[False, True], ids=["batch1", "dynbatch"])
def speaker(request, tmp_path_factory) -> SpeakerEncoder:
    path = tmp_path_factory.mktemp("spk") / "campplus.onnx"
    write_campplus_standin(path, seed=0, dynamic_batch=request.param)
    return SpeakerEncoder(path)


# ------------------------------------------------------------------------------------- stand-ins


@pytest.mark.parametrize("dynamic_batch", [False, True])
def test_standin_signatures_are_the_official_ones(tmp_path: Path, dynamic_batch: bool):
    import onnxruntime as ort

    for write, inputs, outputs in (
        (write_speech_tokenizer_standin, TOKENIZER_INPUTS, TOKENIZER_OUTPUTS),
        (write_campplus_standin, CAMPPLUS_INPUTS, CAMPPLUS_OUTPUTS),
    ):
        path = write(tmp_path / "m.onnx", dynamic_batch=dynamic_batch)
        onnx.checker.check_model(str(path), full_check=True)
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for args, specs in ((sess.get_inputs(), inputs), (sess.get_outputs(), outputs)):
            assert [a.name for a in args] == [s.name for s in specs]
            for arg, spec in zip(args, specs, strict=True):
                assert arg.type == spec.types[0]
                assert len(arg.shape) == spec.rank
                assert all(arg.shape[axis] == size for axis, size in spec.fixed.items())
                assert isinstance(arg.shape[0], str) == dynamic_batch
                if not dynamic_batch:
                    assert arg.shape[0] == 1
                # the time axis is dynamic wherever there is one
                assert all(isinstance(d, str) for i, d in enumerate(arg.shape) if i and i not in spec.fixed)


def test_standins_are_deterministic_and_seeded(tmp_path: Path):
    a = write_speech_tokenizer_standin(tmp_path / "a.onnx", seed=3).read_bytes()
    b = write_speech_tokenizer_standin(tmp_path / "b.onnx", seed=3).read_bytes()
    c = write_speech_tokenizer_standin(tmp_path / "c.onnx", seed=4).read_bytes()
    assert a == b and a != c
    assert campplus_standin(seed=1).SerializeToString() == campplus_standin(seed=1).SerializeToString()
    mel = _mel(np.random.default_rng(0), [200])
    t3 = SpeechTokenizer(tmp_path / "a.onnx").tokenize(mel)[0]
    t4 = SpeechTokenizer(tmp_path / "c.onnx").tokenize(mel)[0]
    assert not np.array_equal(t3, t4)


def test_standin_is_flagged(tokenizer: SpeechTokenizer, speaker: SpeakerEncoder):
    assert tokenizer.standin and "seed=0" in tokenizer.standin
    assert speaker.standin


# ------------------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("n", [*range(1, 13), 99, 100, 101, 2999, 3000])
def test_speech_token_count_is_ceil_quarter(n: int):
    assert speech_token_count(n) == -(-n // 4)
    assert speech_token_count(0) == 0
    np.testing.assert_array_equal(speech_token_count(np.array([1, 4, 5, 8])), [1, 1, 2, 2])


def test_tokens_shape_dtype_range(tokenizer: SpeechTokenizer):
    lengths = [1, 2, 3, 4, 5, 37, 400]
    tokens = tokenizer.tokenize(_mel(np.random.default_rng(1), lengths), np.array(lengths, dtype=np.int32))
    assert len(tokens) == len(lengths)
    for t, n in zip(tokens, lengths, strict=True):
        assert t.dtype == np.int32 and t.ndim == 1
        assert len(t) == speech_token_count(n)
        assert t.min() >= 0 and t.max() < SPEECH_TOKEN_VOCAB
    assert len(np.unique(tokens[-1])) > 20  # plausible variety, not a constant


def test_batch_of_different_lengths_equals_each_alone(tokenizer: SpeechTokenizer):
    rng = np.random.default_rng(2)
    lengths = [160, 7, 333, 64, 65]
    mel = _mel(rng, lengths, pad_value=9.0)  # padding content must not matter
    together = tokenizer.tokenize(mel, lengths)
    for i, n in enumerate(lengths):
        alone = tokenizer.tokenize(mel[i : i + 1, :, :n])[0]
        np.testing.assert_array_equal(together[i], alone)


def test_batched_mode_is_used_when_the_graph_allows_it(tokenizer: SpeechTokenizer):
    dynamic = isinstance(tokenizer.session.get_inputs()[0].shape[0], str)
    assert tokenizer.batched == dynamic


def test_small_max_batch_size_gives_same_tokens(tmp_path: Path):
    path = write_speech_tokenizer_standin(tmp_path / "t.onnx", dynamic_batch=True)
    lengths = [50, 10, 90, 30, 70]
    mel = _mel(np.random.default_rng(3), lengths)
    big = SpeechTokenizer(path, max_batch_size=16).tokenize(mel, lengths)
    small = SpeechTokenizer(path, max_batch_size=2, intra_op_threads=2).tokenize(mel, lengths)
    loop = SpeechTokenizer(path, batching="never").tokenize(mel, lengths)
    for a, b, c in zip(big, small, loop, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_tokens_depend_on_audio(tokenizer: SpeechTokenizer):
    rng = np.random.default_rng(4)
    a, b = tokenizer.tokenize(_mel(rng, [120, 120]))
    assert not np.array_equal(a, b)


def _length_blind(model: onnx.ModelProto) -> onnx.ModelProto:
    """The stand-in rewired to treat every frame as valid: padding then leaks into the tokens."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    nodes = [
        helper.make_node("Shape", ["feats"], ["blind_b"], start=0, end=1),
        helper.make_node("Shape", ["feats"], ["blind_t"], start=2, end=3),
        helper.make_node("Expand", ["blind_t", "blind_b"], ["blind_len64"]),
        helper.make_node("Cast", ["blind_len64"], ["blind_len"], to=TensorProto.INT32),
    ]
    for node in model.graph.node:
        node.input[:] = ["blind_len" if name == "feats_length" else name for name in node.input]
    # keep feats_length used (a no-op) so the signature stays the official one
    nodes.append(helper.make_node("Identity", ["feats_length"], ["blind_unused"]))
    model.graph.output.append(helper.make_tensor_value_info("blind_unused", TensorProto.INT32, None))
    old = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes + old)
    return model


def test_probe_rejects_a_graph_that_ignores_lengths(tmp_path: Path, caplog):
    path = tmp_path / "blind.onnx"
    onnx.save(_length_blind(speech_tokenizer_standin(dynamic_batch=True)), str(path))
    with caplog.at_level(logging.INFO, logger="cosyvoice_triton.frontend.speech_models"):
        tok = SpeechTokenizer(path)
    assert tok.batched is False
    assert "differs" in caplog.text
    lengths = [40, 200]
    mel = _mel(np.random.default_rng(5), lengths, pad_value=3.0)
    together = tok.tokenize(mel, lengths)
    forced = SpeechTokenizer(path, batching="always").tokenize(mel, lengths)
    alone = tok.tokenize(mel[:1, :, :40])[0]
    np.testing.assert_array_equal(together[0], alone)
    assert not np.array_equal(forced[0], alone)  # what an unchecked batched call would have returned


def test_always_needs_a_dynamic_batch_axis(tmp_path: Path):
    path = write_speech_tokenizer_standin(tmp_path / "t.onnx", dynamic_batch=False)
    with pytest.raises(CheckpointError, match="fixed batch axis"):
        SpeechTokenizer(path, batching="always")


def test_tokenizer_input_errors(tokenizer: SpeechTokenizer):
    rng = np.random.default_rng(6)
    with pytest.raises(ValueError, match="128"):
        tokenizer.tokenize(np.zeros((1, 80, 10), dtype=np.float32))
    with pytest.raises(ValueError, match="shape"):
        tokenizer.tokenize(_mel(rng, [10, 10]), [10])
    with pytest.raises(AudioError, match="empty"):
        tokenizer.tokenize(_mel(rng, [10, 10]), [10, 0])
    with pytest.raises(ValueError, match="padded"):
        tokenizer.tokenize(_mel(rng, [10]), [11])
    bad = _mel(rng, [10])
    bad[0, 5, 3] = np.nan
    with pytest.raises(AudioError, match="non-finite"):
        tokenizer.tokenize(bad)
    bad[0, 5, 3] = 0.0
    bad = np.concatenate([bad, np.full((1, 128, 4), np.inf, dtype=np.float32)], axis=2)
    assert len(tokenizer.tokenize(bad, [10])[0]) == 3  # non-finite padding is ignored
    assert tokenizer.tokenize(np.zeros((0, 128, 5), dtype=np.float32)) == []


def test_tokenizer_refuses_more_than_max_frames(tmp_path: Path):
    path = write_speech_tokenizer_standin(tmp_path / "t.onnx")
    tok = SpeechTokenizer(path, max_frames=100)
    mel = _mel(np.random.default_rng(7), [101])
    with pytest.raises(AudioError, match="at most 100 frames"):
        tok.tokenize(mel)
    assert len(tok.tokenize(mel, [100])[0]) == 25
    assert len(SpeechTokenizer(path, max_frames=None).tokenize(mel)[0]) == 26


# --------------------------------------------------------------------------------------- speaker


def test_embedding_shape_dtype(speaker: SpeakerEncoder):
    lengths = [1, 3, 50, 50, 200]
    emb = speaker.embed(_fbank(np.random.default_rng(8), lengths), lengths)
    assert emb.shape == (len(lengths), SPEAKER_EMBED_DIM) and emb.dtype == np.float32
    assert np.all(np.isfinite(emb))
    assert speaker.embed(np.zeros((0, 10, 80), dtype=np.float32)).shape == (0, SPEAKER_EMBED_DIM)


def test_embedding_of_batch_equals_each_alone(speaker: SpeakerEncoder):
    rng = np.random.default_rng(9)
    lengths = [120, 40, 120, 77, 40, 120]
    feats = _fbank(rng, lengths, pad_value=-50.0)  # padding content must not matter
    together = speaker.embed(feats, lengths)
    for i, n in enumerate(lengths):
        alone = speaker.embed(feats[i : i + 1, :n])
        np.testing.assert_allclose(together[i], alone[0], rtol=1e-5, atol=1e-6)


def test_embedding_groups_equal_lengths(tmp_path: Path):
    path = write_campplus_standin(tmp_path / "c.onnx", dynamic_batch=True)
    batched = SpeakerEncoder(path, max_batch_size=2)
    looped = SpeakerEncoder(path, batching="never")
    assert batched.batched and not looped.batched
    lengths = [60, 60, 60, 30, 60, 30]
    feats = _fbank(np.random.default_rng(10), lengths)
    np.testing.assert_allclose(
        batched.embed(feats, lengths), looped.embed(feats, lengths), rtol=1e-5, atol=1e-6
    )


def test_embedding_mean_normalisation_is_idempotent(speaker: SpeakerEncoder):
    feats = _fbank(np.random.default_rng(11), [90])
    normalised = feats - feats.mean(axis=1, keepdims=True)
    np.testing.assert_allclose(speaker.embed(feats), speaker.embed(normalised), rtol=1e-4, atol=1e-5)


def test_embedding_depends_on_audio(speaker: SpeakerEncoder):
    emb = speaker.embed(_fbank(np.random.default_rng(12), [100, 100]))
    assert np.max(np.abs(emb[0] - emb[1])) > 1e-3


def test_speaker_input_errors(speaker: SpeakerEncoder):
    with pytest.raises(ValueError, match="80"):
        speaker.embed(np.zeros((1, 10, 128), dtype=np.float32))
    with pytest.raises(AudioError, match="empty"):
        speaker.embed(np.zeros((1, 10, 80), dtype=np.float32), [0])
    with pytest.raises(AudioError, match="non-finite"):
        speaker.embed(np.full((1, 10, 80), np.nan, dtype=np.float32))


# --------------------------------------------------------------------------------- bad checkpoints


def _renamed_input(model: onnx.ModelProto, old: str, new: str) -> onnx.ModelProto:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for value in model.graph.input:
        if value.name == old:
            value.name = new
    for node in model.graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
    return model


@pytest.mark.parametrize("cls", [SpeechTokenizer, SpeakerEncoder])
def test_missing_empty_corrupt_files(tmp_path: Path, cls):
    with pytest.raises(CheckpointError, match="not found") as info:
        cls(tmp_path / "absent.onnx")
    assert "absent.onnx" in str(info.value)
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        cls(empty)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(CheckpointError, match=r"junk\.onnx") as info:
        cls(junk)
    assert isinstance(info.value, CosyVoiceError)
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(speech_tokenizer_standin().SerializeToString()[:2000])
    with pytest.raises(CheckpointError, match=r"truncated\.onnx"):
        cls(truncated)


def test_wrong_input_name_is_named(tmp_path: Path):
    path = tmp_path / "renamed.onnx"
    onnx.save(_renamed_input(speech_tokenizer_standin(), "feats_length", "x_len"), str(path))
    with pytest.raises(CheckpointError) as info:
        SpeechTokenizer(path)
    msg = str(info.value)
    assert "renamed.onnx" in msg and "'x_len'" in msg and "'feats_length'" in msg and "input #1" in msg

    onnx.save(_renamed_input(campplus_standin(), "input", "feature"), str(path))
    with pytest.raises(CheckpointError, match=r"'feature'.*'input'"):
        SpeakerEncoder(path)


def test_wrong_dtype_and_size_are_named(tmp_path: Path):
    model = speech_tokenizer_standin()
    model.graph.input[1].type.tensor_type.elem_type = TensorProto.INT64
    path = tmp_path / "int64.onnx"
    onnx.save(model, str(path))
    with pytest.raises(CheckpointError, match=r"tensor\(int64\).*tensor\(int32\)"):
        SpeechTokenizer(path)

    # a 512-d speaker model (e.g. the VoxCeleb CAM++) with the right names: mean over time + a linear layer
    weight = onnx.numpy_helper.from_array(np.zeros((80, 512), dtype=np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["input"], ["pooled"], axes=[1], keepdims=0),
            helper.make_node("MatMul", ["pooled", "w"], ["output"]),
        ],
        "speaker512",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 512])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "512.onnx"
    onnx.save(model, str(path))
    with pytest.raises(CheckpointError, match=r"output #0 is .*\[1, 512\], wrong size of axis 1"):
        SpeakerEncoder(path)


def test_swapped_models_are_rejected(tmp_path: Path):
    tok = write_speech_tokenizer_standin(tmp_path / "speech_tokenizer_v2.onnx")
    spk = write_campplus_standin(tmp_path / "campplus.onnx")
    with pytest.raises(CheckpointError, match="has 1 inputs"):
        SpeechTokenizer(spk)
    with pytest.raises(CheckpointError, match="has 2 inputs"):
        SpeakerEncoder(tok)
