"""CosyVoice3's DiT flow (``models/cosyvoice3``) against the official outputs in tests/fixtures/cv3_flow_oracle.

The oracle was computed by the official ``CausalMaskedDiffWithDiT`` on seeded random weights; ``flow.pt`` is
regenerated here from the same draws and checked by digest (tests/oracle/cosyvoice3_flow.md).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import FEAT_BAR, FIXTURES, oracle_fixtures, oracle_script, rel_err

from cosyvoice_triton.errors import CheckpointError
from cosyvoice_triton.models.cfm import cosine_t_span
from cosyvoice_triton.models.cosyvoice3.dit import rotary_inv_freq
from cosyvoice_triton.models.cosyvoice3.flow import CausalMaskedDiffWithDiT, Flow3Dims, load_flow3

ORACLE = FIXTURES / "cv3_flow_oracle"
CASES = ["nonstream", "misaligned", "stream_chunk1", "stream_chunk2", "stream_final", "stream_final_chunked"]
#: One estimator call and every stage of the flow: bit-identical on the CPU that made the oracle (see the .md);
#: 1e-5 relative leaves room for another CPU's float32 kernels, like CosyVoice2's FEAT_BAR.
EST_BAR = 1e-5


def _oracle_script():
    return oracle_script("make_cv3_flow_oracle")


meta, ref = oracle_fixtures(ORACLE)


@pytest.fixture(scope="module")
def dims() -> Flow3Dims:
    return Flow3Dims.from_dict(json.loads((ORACLE / "cv3_flow_dims.json").read_text())["project"])


@pytest.fixture(scope="module")
def flow_pt(tmp_path_factory, meta):
    """The oracle's tiny flow.pt, regenerated from the seeded draws and checked against the digest the official
    code loaded."""
    folder = tmp_path_factory.mktemp("cv3_flow")
    w = meta["weights"]
    digest = _oracle_script().write_weights(folder, meta["seeds"]["weights"], w["rotary_inv_freq_hex"])
    assert digest == w["state_sha256"], (
        "flow.pt regenerated from the seeded draws differs from the oracle's: torch's normal draws follow another "
        "kernel here, or the oracle was regenerated without this test's update")
    return folder / "flow.pt"


@pytest.fixture(scope="module")
def flow(flow_pt, dims) -> CausalMaskedDiffWithDiT:
    return load_flow3(flow_pt, dims)


def _t(a):
    return torch.from_numpy(np.asarray(a))


def _inputs(z):
    return (_t(z["token"]), _t(z["prompt_token"]), _t(z["prompt_feat"]), _t(z["embedding"]))


# ------------------------------------------------------------------------------------------------ the estimator
@pytest.mark.parametrize("name", ["estimator_nonstream", "estimator_stream"])
def test_estimator_matches_official(flow, ref, name):
    """B=2, item 1 padded from frame 90, T=130 (three 50-frame chunks when streaming); padded frames included."""
    z = ref(name)
    with torch.inference_mode():
        out = flow.decoder.estimator(*(_t(z[k]) for k in ("x", "mask", "mu", "t", "spks", "cond")),
                                     streaming=bool(z["streaming"]))
    assert rel_err(out, z["out"]) <= EST_BAR
    pad_from = int(z["mask"][1, 0].sum())
    assert rel_err(out[1, :, :pad_from], z["out"][1, :, :pad_from]) <= EST_BAR


def test_estimator_streaming_modes_differ(flow, ref):
    """The two estimator cases differ (the chunk mask matters), and a [B] tensor picks the mode per row."""
    a, b = ref("estimator_nonstream"), ref("estimator_stream")
    assert rel_err(a["out"], b["out"]) > 1e-3
    args = [_t(a[k]) for k in ("x", "mask", "mu", "t", "spks", "cond")]
    with torch.inference_mode():
        mixed = flow.decoder.estimator(*args, streaming=torch.tensor([True, False]))
    assert rel_err(mixed[0], b["out"][0]) <= EST_BAR
    assert rel_err(mixed[1], a["out"][1]) <= EST_BAR


def test_rotary_on_first_head_only_is_what_the_oracle_sees(flow, ref, monkeypatch):
    """Rotating every head (the usual RoPE) instead of the first ``dim_head`` channels misses the oracle by far."""
    from cosyvoice_triton.models.cosyvoice3 import dit as dit_mod

    z = ref("estimator_nonstream")
    heads = flow.dims.dit.heads
    monkeypatch.setattr(dit_mod.RotaryEmbedding, "forward", lambda self, n: _all_heads_freqs(self, n, heads))
    with torch.inference_mode():
        out = flow.decoder.estimator(*(_t(z[k]) for k in ("x", "mask", "mu", "t", "spks", "cond")))
    assert rel_err(out, z["out"]) > 100 * EST_BAR


def _all_heads_freqs(rotary, n: int, heads: int) -> torch.Tensor:
    """Angles for every channel of q / k, each head rotated like the first."""
    t = torch.arange(n).float().reshape(1, -1, 1) * rotary.inv_freq
    return torch.stack((t, t), dim=-1).flatten(-2).repeat(1, 1, heads)


# ------------------------------------------------------------------------------------------------ the flow
@pytest.mark.parametrize("case", CASES)
def test_flow_matches_official(flow, ref, case):
    z = ref(f"flow_{case}")
    with torch.inference_mode():
        c = flow.condition(*_inputs(z), finalize=bool(z["finalize"]))
        assert rel_err(c.spks, z["spks"]) <= 1e-6
        assert rel_err(c.mu, z["mu"]) <= EST_BAR
        np.testing.assert_array_equal(c.cond.numpy(), z["cond"])
        np.testing.assert_array_equal(c.mask.numpy(), z["mask"])
        feat, feat_len = flow.inference(*_inputs(z), streaming=bool(z["streaming"]), finalize=bool(z["finalize"]))
    assert feat.shape == z["feat"].shape
    assert int(feat_len[0]) == z["feat"].shape[-1]
    assert rel_err(feat, z["feat"]) <= FEAT_BAR


@pytest.mark.parametrize("case", ["nonstream", "stream_chunk2", "stream_final_chunked"])
def test_flow_euler_steps_match_official(flow, ref, case):
    """Each kept Euler step: the estimator on the official step input (the CFG batch: conditional row, then mu,
    spks and cond zeroed); the time grid and every step's t."""
    z = ref(f"flow_{case}")
    t_span = cosine_t_span(int(z["n_timesteps"]))
    np.testing.assert_array_equal(t_span.numpy(), z["t_span"])
    t, ts = t_span[0:1], []
    for k in range(len(t_span) - 1):  # the solver accumulates t (t += dt) rather than reading the grid
        ts.append(float(t))
        t = t + (t_span[k + 1] - t)
    np.testing.assert_array_equal(np.asarray(ts, np.float32), z["est_t"])
    mu, mask, spks, cond = (_t(z[k]) for k in ("mu", "mask", "spks", "cond"))
    for i, step in enumerate(z["est_steps"]):
        x = _t(z["est_x"][i])
        with torch.inference_mode():
            out = flow.decoder.estimator(
                x.expand(2, -1, -1), mask.expand(2, -1, -1), torch.cat([mu, torch.zeros_like(mu)]),
                _t(z["est_t"][step]).expand(2), torch.cat([spks, torch.zeros_like(spks)]),
                torch.cat([cond, torch.zeros_like(cond)]), bool(z["streaming"]))
        assert rel_err(out, z["est_out"][i]) <= EST_BAR, f"Euler step {step}"


@pytest.mark.parametrize("case", ["nonstream", "stream_chunk1"])
def test_solver_on_official_condition(flow, ref, case):
    """The CFM solver alone, from the official mu / mask / spks / cond, and the fixed noise's digest."""
    z = ref(f"flow_{case}")
    from make_flow_oracle import sha256

    assert sha256(flow.decoder.noise(z["mu"].shape[-1])) == str(z["z0_sha256"])
    with torch.inference_mode():
        mel = flow.decoder(*(_t(z[k]) for k in ("mu", "mask", "spks", "cond")), streaming=bool(z["streaming"]))
    assert rel_err(mel[:, :, z["prompt_feat"].shape[1]:], z["feat"]) <= FEAT_BAR


def test_stream_chunk_frames_equal_the_final_streaming_run(flow, ref):
    """A chunk (look-ahead tokens given, chunk-causal attention, the mel ending on a chunk boundary) yields the frames
    the finalized streaming run yields for them: what lets token2wav emit chunks."""
    with torch.inference_mode():
        chunk, _ = flow.inference(*_inputs(ref("flow_stream_chunk1")), streaming=True, finalize=False)
        final, _ = flow.inference(*_inputs(ref("flow_stream_final_chunked")), streaming=True, finalize=True)
    assert chunk.shape[-1] == 60
    assert rel_err(chunk, final[:, :, :60]) <= EST_BAR


def test_finalize_false_drops_the_lookahead(flow, ref):
    z = ref("flow_stream_chunk1")
    with torch.inference_mode():
        a, _ = flow.inference(*_inputs(z), streaming=True, finalize=False)
        b, _ = flow.inference(*_inputs(z), streaming=True, finalize=True)
    assert b.shape[-1] == a.shape[-1] + 2 * flow.pre_lookahead_len
    with pytest.raises(ValueError, match="more than 3 tokens"):
        flow.inference(torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32),
                       torch.zeros(1, 0, 80), torch.ones(1, 192), finalize=False)


def _pad(items, key, dtype, fill):
    arrs = [z[key][0] for z in items]
    t = max(a.shape[0] for a in arrs)
    out = np.full((len(arrs), t, *arrs[0].shape[1:]), fill, dtype=dtype)  # garbage padding must not matter
    for i, a in enumerate(arrs):
        out[i, : a.shape[0]] = a
    return torch.from_numpy(out), torch.tensor([a.shape[0] for a in arrs])


@pytest.mark.parametrize(("cases", "streaming", "finalize"), [
    (("nonstream", "misaligned"), False, True), (("stream_chunk2", "stream_chunk1"), True, False)])
def test_flow_batch_equals_official(flow, ref, cases, streaming, finalize):
    """Utterances of different lengths in one padded call each get the official output."""
    items = [ref(f"flow_{c}") for c in cases]
    token, token_len = _pad(items, "token", np.int32, 7)
    prompt_token, prompt_len = _pad(items, "prompt_token", np.int32, 7)
    prompt_feat, feat_len = _pad(items, "prompt_feat", np.float32, 3.0)
    emb = torch.from_numpy(np.concatenate([z["embedding"] for z in items]))
    with torch.inference_mode():
        mel, mel_len = flow.inference(token, prompt_token, prompt_feat, emb, token_len=token_len,
                                      prompt_token_len=prompt_len, prompt_feat_len=feat_len, streaming=streaming,
                                      finalize=finalize)
    for i, z in enumerate(items):
        n = z["feat"].shape[-1]
        assert int(mel_len[i]) == n
        assert rel_err(mel[i : i + 1, :, :n], z["feat"]) <= FEAT_BAR
        assert not mel[i, :, n:].any()


# ------------------------------------------------------------------------------------------------ weights, loading
def test_oracle_weights_and_noise(meta, flow):
    from make_flow_oracle import sha256

    assert sha256(flow.decoder.rand_noise) == meta["cfm_rand_noise_sha256"]
    want = torch.tensor([float.fromhex(v) for v in meta["weights"]["rotary_inv_freq_hex"]])
    assert torch.equal(flow.decoder.estimator.rotary_embed.inv_freq, want)
    # the release's formula, as x-transformers computes it (one float32 ulp of room for another CPU's pow)
    np.testing.assert_allclose(rotary_inv_freq(16).numpy(), want.numpy(), rtol=2.4e-7, atol=0)


def _state(flow_pt):
    return torch.load(flow_pt, map_location="cpu", weights_only=True)


def test_load_refuses_a_missing_key(flow_pt, dims, tmp_path):
    state = _state(flow_pt)
    del state["decoder.estimator.transformer_blocks.1.attn.to_k.bias"]
    torch.save(state, tmp_path / "flow.pt")
    key = "decoder.estimator.transformer_blocks.1.attn.to_k.bias"
    with pytest.raises(CheckpointError, match=rf"1 missing \({re.escape(key)}\)"):
        load_flow3(tmp_path / "flow.pt", dims)


def test_load_refuses_a_wrong_shape(flow_pt, dims, tmp_path):
    state = _state(flow_pt)
    state["pre_lookahead_layer.conv1.weight"] = state["pre_lookahead_layer.conv1.weight"][:, :, :3]
    torch.save(state, tmp_path / "flow.pt")
    with pytest.raises(CheckpointError, match=r"pre_lookahead_layer\.conv1\.weight: file \(64, 80, 3\) vs model "
                                              r"\(64, 80, 4\)"):
        load_flow3(tmp_path / "flow.pt", dims)


def test_load_refuses_other_dims_and_cosyvoice2(flow_pt, tmp_path):
    with pytest.raises(CheckpointError, match="with another shape"):
        load_flow3(flow_pt)  # the tiny file against the release's dims
    state = _state(flow_pt)
    state["encoder_proj.weight"] = torch.zeros(80, 512)
    torch.save(state, tmp_path / "flow.pt")
    with pytest.raises(CheckpointError, match="CosyVoice2 flow"):
        load_flow3(tmp_path / "flow.pt")


def test_load_refuses_pickled_code(tmp_path, dims):
    torch.save({"x": torch.zeros(1), "f": print}, tmp_path / "flow.pt")
    with pytest.raises(CheckpointError, match="pickled objects"):
        load_flow3(tmp_path / "flow.pt", dims)


def test_full_flow_keys():
    """The release dims give exactly the official module's keys, shapes and dtypes (listed from the official
    flow built at cosyvoice3.yaml's dims)."""
    expected = {}
    for line in (FIXTURES / "cv3_flow_keys_full.txt").read_text().splitlines():
        key, shape, dtype = line.split("\t")
        expected[key] = (tuple(int(x) for x in shape.strip("()").split(",") if x.strip()), dtype)
    with torch.device("meta"):
        model = CausalMaskedDiffWithDiT(Flow3Dims.full())
    got = {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in model.state_dict().items()}
    assert got == expected
    assert list(got) == list(expected)


def test_tiny_dims_keep_the_structure():
    """The tiny dims differ from the release's in widths and depth only: the same keys up to block numbers."""
    with torch.device("meta"):
        full_keys = {_generic(k) for k in CausalMaskedDiffWithDiT(Flow3Dims.full()).state_dict()}
        tiny_keys = {_generic(k) for k in CausalMaskedDiffWithDiT(Flow3Dims.tiny()).state_dict()}
    assert full_keys == tiny_keys


def _generic(key: str) -> str:
    return ".".join("N" if part.isdigit() and i == 3 else part for i, part in enumerate(key.split(".")))
