"""UpsampleConformerEncoder: official parity on the oracle, full-size keys, padded batches, ONNX export."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FIXTURES, flow_oracle_script, rel_err

from cosyvoice_triton.config import ModelConfig
from cosyvoice_triton.models.encoder import UpsampleConformerEncoder, chunk_attention_mask

FLOW_CASES = ["flow_nonstream", "flow_vc_misaligned", "flow_stream_chunk", "flow_stream_final"]


def _tiny_encoder(seed: int = 0) -> UpsampleConformerEncoder:
    """Tiny encoder with random weights, biases and LayerNorm affines perturbed so nothing is trivial."""
    torch.manual_seed(seed)
    enc = UpsampleConformerEncoder(ModelConfig.tiny().flow.encoder).eval()
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if name.endswith("bias") or "norm" in name or ".out.1." in name:
                p.add_(0.05 * torch.randn_like(p))
    return enc


def _load_encoder(flow_pt):
    """(encoder, encoder_proj, input_embedding weight) of a flow.pt, loaded strictly."""
    sd = torch.load(flow_pt, weights_only=True, map_location="cpu")
    enc = UpsampleConformerEncoder(ModelConfig.tiny().flow.encoder).eval()
    proj = torch.nn.Linear(512, 80).eval()
    for module, prefix in ((enc, "encoder."), (proj, "encoder_proj.")):
        part = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
        module.load_state_dict(part, strict=True)
    return enc, proj, sd["input_embedding.weight"]


@pytest.fixture(scope="module")
def oracle(tiny_dir):
    return _load_encoder(tiny_dir / "flow.pt")


def _token_embeddings(table, z) -> torch.Tensor:
    """The official embedding of prompt + source tokens (the oracle kept its digest, not the array)."""
    tokens = torch.from_numpy(np.concatenate([z["prompt_token"], z["token"]], axis=1)).long()
    emb = table[tokens]
    assert flow_oracle_script().sha256(emb) == str(z["token_emb_raw_sha256"])
    return emb


def _run_case(enc, table, z, with_context=True):
    emb = _token_embeddings(table, z)
    xs = emb[:, : int(z["encoder_in_frames"])]
    context = None
    if with_context and not bool(z["finalize"]):
        # the look-ahead tokens are the embeddings that the encoder input lacks
        context = emb[:, xs.shape[1]:]
        assert context.shape[1] == int(z["pre_lookahead_len"])
    with torch.no_grad():
        return enc(xs, torch.from_numpy(z["encoder_in_len"]), context, streaming=bool(z["streaming"]))


@pytest.mark.parametrize("case", FLOW_CASES)
def test_oracle_parity(oracle, ref_npz, case):
    enc, proj, table = oracle
    z = ref_npz(case)
    out, mask = _run_case(enc, table, z)
    assert out.dtype == torch.float32 and mask.dtype == torch.bool
    assert rel_err(out.numpy(), z["encoder_out"]) <= 1e-5
    np.testing.assert_array_equal(mask.numpy(), z["encoder_mask"])
    with torch.no_grad():
        assert rel_err(proj(out).transpose(1, 2).numpy(), z["mu"]) <= 1e-5


def test_oracle_context_and_streaming_matter(oracle, ref_npz):
    """Guards against a test that passes by accident: dropping the context or the chunk mask breaks parity."""
    enc, _, table = oracle
    z = ref_npz("flow_stream_chunk")
    out, _ = _run_case(enc, table, z, with_context=False)
    assert rel_err(out.numpy(), z["encoder_out"]) > 1e-3
    z = dict(ref_npz("flow_stream_final"), streaming=np.array(False))
    out, _ = _run_case(enc, table, z)
    assert rel_err(out.numpy(), ref_npz("flow_stream_final")["encoder_out"]) > 1e-3


@pytest.mark.parametrize("case", FLOW_CASES)
def test_external_reference_parity(external_tiny_dir, external_npz, case):
    """Cross-check on the external reference folder (official outputs made on another machine)."""
    enc, proj, _ = _load_encoder(external_tiny_dir / "flow.pt")
    z = external_npz(case)
    context = None
    if not bool(z["finalize"]):
        context = torch.from_numpy(z["token_emb_raw"][:, z["encoder_in"].shape[1]:])
    with torch.no_grad():
        out, _ = enc(torch.from_numpy(z["encoder_in"]), torch.from_numpy(z["encoder_in_len"]), context,
                     streaming=bool(z["streaming"]))
        assert rel_err(out.numpy(), z["encoder_out"]) <= 1e-4
        assert rel_err(proj(out).numpy(), z["h"]) <= 1e-4


def test_full_size_state_dict_keys():
    expected = {}
    for line in (FIXTURES / "flow_keys_full.txt").read_text().splitlines():
        key, shape, dtype = line.split("\t")
        if key.startswith("encoder."):
            expected[key] = (shape, dtype)
    enc = UpsampleConformerEncoder(ModelConfig.full().flow.encoder)
    got = {f"encoder.{k}": (str(tuple(v.shape)), str(v.dtype).replace("torch.", ""))
           for k, v in enc.state_dict().items()}
    assert got == expected
    assert sum(v.numel() for v in enc.state_dict().values()) == 37_831_168


def test_chunk_mask():
    valid = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    m = chunk_attention_mask(valid, 2, torch.tensor(True))
    assert m[0].int().tolist() == [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0],
                                   [1, 1, 1, 1, 1]]
    assert m[1].int().tolist() == [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0],
                                   [1, 1, 1, 0, 0]]
    no_chunks = chunk_attention_mask(valid, 2, torch.tensor(False))
    assert torch.equal(no_chunks, valid.unsqueeze(1).expand(2, 5, 5))


@pytest.mark.parametrize("streaming", [False, True])
def test_padded_batch_equals_single_runs(streaming):
    """Items of a padded batch equal their solo runs (T crosses the chunk size 25 to exercise the chunks)."""
    enc = _tiny_encoder()
    lens = [61, 34]
    torch.manual_seed(1)
    items = [torch.randn(1, n, 512) for n in lens]
    ctx = torch.randn(2, 3, 512)
    xs = torch.zeros(2, max(lens), 512)
    xs[:, :, :] = 3.0  # padding garbage must not matter
    for i, x in enumerate(items):
        xs[i, : lens[i]] = x[0]
    with torch.no_grad():
        for context, context_lens in [(None, None), (ctx, None), (ctx, torch.tensor([0, 3]))]:
            out, mask = enc(xs, torch.tensor(lens), context, streaming, context_lens)
            assert out.shape == (2, 2 * max(lens), 512)
            assert mask[:, 0].sum(1).tolist() == [2 * n for n in lens]
            for i, n in enumerate(lens):
                use_ctx = context is not None and (context_lens is None or int(context_lens[i]) > 0)
                item_ctx = ctx[i : i + 1] if use_ctx else None
                ref, ref_mask = enc(items[i], torch.tensor([n]), item_ctx, streaming)
                assert ref_mask.all()
                assert rel_err(out[i : i + 1, : 2 * n].numpy(), ref.numpy()) <= 1e-5
            assert torch.isfinite(out).all()


def test_streaming_tensor_flag_and_short_context():
    """A 0-d bool tensor selects like the Python bool; a context shorter than P is zero-padded."""
    enc = _tiny_encoder()
    torch.manual_seed(2)
    xs, lens, ctx = torch.randn(1, 30, 512), torch.tensor([30]), torch.randn(1, 2, 512)
    with torch.no_grad():
        for flag in (False, True):
            a, _ = enc(xs, lens, streaming=flag)
            b, _ = enc(xs, lens, streaming=torch.tensor(flag))
            assert torch.equal(a, b)
        short, _ = enc(xs, lens, ctx, True)
        padded, _ = enc(xs, lens, torch.cat([ctx, torch.zeros(1, 1, 512)], 1), True, torch.tensor([2]))
        assert rel_err(short.numpy(), padded.numpy()) <= 1e-6


def test_onnx_export_dynamic(tmp_path):
    """Legacy exporter, dynamic batch/time, streaming and context_lens as inputs; checked at new lengths."""
    ort = pytest.importorskip("onnxruntime")
    enc = _tiny_encoder()

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = enc

        def forward(self, xs, xs_lens, context, context_lens, streaming):
            return self.enc(xs, xs_lens, context, streaming, context_lens)

    torch.manual_seed(3)
    args = (torch.randn(2, 40, 512), torch.tensor([40, 31]), torch.randn(2, 3, 512), torch.tensor([3, 0]),
            torch.tensor(True))
    path = tmp_path / "encoder.onnx"
    torch.onnx.export(
        Wrapped().eval(), args, str(path), dynamo=False, opset_version=17,
        input_names=["xs", "xs_lens", "context", "context_lens", "streaming"],
        output_names=["encoder_out", "encoder_mask"],
        dynamic_axes={"xs": {0: "B", 1: "T"}, "xs_lens": {0: "B"}, "context": {0: "B"},
                      "context_lens": {0: "B"}, "encoder_out": {0: "B", 1: "T2"},
                      "encoder_mask": {0: "B", 2: "T2"}},
    )
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["xs", "xs_lens", "context", "context_lens", "streaming"]
    for b, t, lens, ctx_lens, streaming in [(1, 57, [57], [0], False), (3, 83, [83, 52, 9], [3, 0, 3], True),
                                            (2, 26, [26, 20], [3, 3], False)]:
        feeds = {"xs": np.random.default_rng(t).standard_normal((b, t, 512), dtype=np.float32),
                 "xs_lens": np.array(lens, dtype=np.int64),
                 "context": np.random.default_rng(b).standard_normal((b, 3, 512), dtype=np.float32),
                 "context_lens": np.array(ctx_lens, dtype=np.int64),
                 "streaming": np.array(streaming)}
        got_out, got_mask = sess.run(None, feeds)
        with torch.no_grad():
            ref_out, ref_mask = Wrapped().eval()(*(torch.from_numpy(v) for v in feeds.values()))
        assert rel_err(got_out, ref_out.numpy()) <= 1e-4
        np.testing.assert_array_equal(got_mask, ref_mask.numpy())
