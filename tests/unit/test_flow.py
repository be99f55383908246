"""The whole flow (``CausalMaskedDiffWithXvec``) against the official outputs, and batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FEAT_BAR, FIXTURES, rel_err

from cosyvoice_triton.config import ModelConfig
from cosyvoice_triton.models.checkpoint import check_flow_revision, load_into, read_state_dict
from cosyvoice_triton.models.flow import CausalMaskedDiffWithXvec, concat_padded

CASES = ["nonstream", "vc_misaligned", "stream_chunk", "stream_final"]


def _load_flow(path):
    state = read_state_dict(path)
    check_flow_revision(state, path)
    model = CausalMaskedDiffWithXvec(ModelConfig.tiny().flow).eval()
    load_into(model, state, path)
    return model


@pytest.fixture(scope="module")
def flow(tiny_dir):
    return _load_flow(tiny_dir / "flow.pt")


def _inputs(z):
    t = lambda k: torch.from_numpy(z[k])
    # `token` already ends with the 3 look-ahead tokens when finalize=False (`context_tokens` repeats them)
    return (t("token"), t("prompt_token"), t("prompt_feat"), t("embedding")), dict(
        streaming=bool(z["streaming"]), finalize=bool(z["finalize"])
    )


@pytest.mark.parametrize("case", CASES)
def test_flow_matches_official(flow, ref_npz, case):
    z = ref_npz(f"flow_{case}")
    args, kw = _inputs(z)
    with torch.inference_mode():
        c = flow.condition(*args, **kw)
        assert rel_err(c.spks, z["spks"]) <= 1e-6
        assert rel_err(c.mu, z["mu"]) <= 1e-5
        assert rel_err(c.cond, z["cond"]) <= 1e-6
        np.testing.assert_array_equal(c.mask.numpy(), z["mask"])
        feat, feat_len = flow.inference(*args, **kw)
    assert feat.shape == z["feat"].shape
    assert int(feat_len[0]) == z["feat"].shape[-1]
    assert rel_err(feat, z["feat"]) <= FEAT_BAR


@pytest.mark.parametrize("case", CASES)
def test_flow_matches_external_reference(external_tiny_dir, external_npz, case):
    """Cross-check on the external reference folder (official outputs made on another machine)."""
    flow = _load_flow(external_tiny_dir / "flow.pt")
    z = external_npz(f"flow_{case}")
    args, kw = _inputs(z)
    with torch.inference_mode():
        feat, _ = flow.inference(*args, **kw)
    assert rel_err(feat, z["feat"]) <= 1e-4


def test_flow_batch_equals_single(flow, ref_npz):
    """Two utterances of different lengths (and streaming modes that agree) in one padded call."""
    items = [ref_npz("flow_nonstream"), ref_npz("flow_vc_misaligned")]
    singles = []
    with torch.inference_mode():
        for z in items:
            args, kw = _inputs(z)
            singles.append(flow.inference(*args, **kw)[0][0])

        def pad(key, dtype):
            arrs = [z[key][0] for z in items]
            t = max(a.shape[0] for a in arrs)
            out = np.zeros((len(arrs), t, *arrs[0].shape[1:]), dtype=dtype)
            for i, a in enumerate(arrs):
                out[i, : a.shape[0]] = a
                out[i, a.shape[0]:] = 7 if dtype == np.int32 else 3.0  # garbage padding must not matter
            return torch.from_numpy(out), torch.tensor([a.shape[0] for a in arrs])

        token, token_len = pad("token", np.int32)
        prompt_token, prompt_len = pad("prompt_token", np.int32)
        prompt_feat, feat_len = pad("prompt_feat", np.float32)
        emb = torch.from_numpy(np.concatenate([z["embedding"] for z in items]))
        mel, mel_len = flow.inference(token, prompt_token, prompt_feat, emb, token_len=token_len,
                                      prompt_token_len=prompt_len, prompt_feat_len=feat_len)
    for i, single in enumerate(singles):
        assert int(mel_len[i]) == single.shape[-1]
        assert rel_err(mel[i, :, : single.shape[-1]], single) <= 1e-5
        assert not mel[i, :, single.shape[-1]:].any()


def test_flow_streaming_chunk_uses_lookahead(flow, ref_npz):
    """finalize=False must really treat the last 3 tokens as look-ahead only (output 2 frames shorter each)."""
    z = ref_npz("flow_stream_chunk")
    args, kw = _inputs(z)
    with torch.inference_mode():
        a, _ = flow.inference(*args, **kw)
        b, _ = flow.inference(*args, streaming=True, finalize=True)
    assert b.shape[-1] == a.shape[-1] + 2 * flow.pre_lookahead_len


def test_concat_padded():
    a = torch.tensor([[1, 2, 0], [3, 0, 0]])
    b = torch.tensor([[4, 9], [5, 6]])
    out, lens = concat_padded(a, torch.tensor([2, 1]), b, torch.tensor([1, 2]))
    assert lens.tolist() == [3, 3]
    assert out.tolist() == [[1, 2, 4], [3, 5, 6]]


def test_full_flow_keys():
    expected = {}
    for line in (FIXTURES / "flow_keys_full.txt").read_text().splitlines():
        key, shape, dtype = line.split("\t")
        expected[key] = (tuple(int(x) for x in shape.strip("()").split(",") if x.strip()), dtype)
    with torch.device("meta"):
        model = CausalMaskedDiffWithXvec(ModelConfig.full().flow)
    got = {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in model.state_dict().items()}
    assert got == expected
    assert sum(v.numel() for v in model.state_dict().values()) == 112_549_360
