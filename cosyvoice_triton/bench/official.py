"""Import the OFFICIAL CosyVoice code from a checkout, for oracles and side-by-side benchmarks only.

The library never depends on it. ``import_official(path, "cosyvoice.llm.llm")`` puts the checkout (and its
``third_party/Matcha-TTS``) on ``sys.path`` and stubs the modules that cannot import with the CPU torch here
(torchaudio, whose PyPI builds need CUDA libraries; lightning, which Matcha-TTS imports only for a logging
decorator; the ``__init__`` of ``matcha.utils``, which pulls in hydra and rich for training: its submodules
import from their files as usual). Nothing the stubbed modules provide is called on the paths used (LM inference,
flow, HiFT).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch

from ..errors import CheckpointError

# The sampling section of the official cosyvoice2.yaml (llm.sampling: ras_sampling) and the inference defaults
# of Qwen2LM.inference.
OFFICIAL_SAMPLING = {"top_p": 0.8, "top_k": 25, "win_size": 10, "tau_r": 0.1}
OFFICIAL_TOKEN_TEXT_RATIO = {"min_token_text_ratio": 2.0, "max_token_text_ratio": 20.0}

STUBBED: list[str] = []


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # transformers probes find_spec on it
    module.__dict__.update(attrs)
    sys.modules[name] = module
    STUBBED.append(name)
    return module


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # torchaudio raises OSError (missing CUDA libraries), not only ImportError
        sys.modules.pop(name, None)
        return False
    return True


def import_official(checkout: str | Path, *modules: str) -> list[types.ModuleType]:
    """Import ``modules`` (dotted names) from an official CosyVoice checkout; returns them in order."""
    checkout = Path(checkout).resolve()
    if not (checkout / "cosyvoice" / "llm" / "llm.py").is_file():
        raise CheckpointError(f"{checkout}: not a checkout of the official CosyVoice code (no cosyvoice/llm/llm.py)")
    matcha = checkout / "third_party" / "Matcha-TTS"
    for path in (str(matcha), str(checkout)):
        if path not in sys.path:
            sys.path.insert(0, path)
    if "torchaudio" not in sys.modules and not _importable("torchaudio"):
        torchaudio = _stub("torchaudio")
        torchaudio.compliance = _stub("torchaudio.compliance")
        torchaudio.compliance.kaldi = _stub("torchaudio.compliance.kaldi")
    if "lightning" not in sys.modules and importlib.util.find_spec("lightning") is None:
        _stub("lightning")
        _stub("lightning.pytorch")
        _stub("lightning.pytorch.utilities", rank_zero_only=lambda fn: fn)
    if (matcha / "matcha" / "utils").is_dir() and "matcha.utils" not in sys.modules:
        # an attribute of the package too, as an import would make it: HyperPyYAML's !name: tags walk it
        importlib.import_module("matcha").utils = _stub("matcha.utils", __path__=[str(matcha / "matcha" / "utils")])
    return [importlib.import_module(name) for name in modules]


def stub_frontend_imports() -> None:
    """Stub what the official front-end modules import and the model paths never call: ``whisper`` (its
    ``log_mel_spectrogram``, for ``_extract_speech_token``) and ``whisper.tokenizer`` / ``tiktoken`` (the
    CosyVoice1 tokenizer), imported by ``cosyvoice.tokenizer.tokenizer``, which a cosyvoice3.yaml names
    (``get_tokenizer``); ``modelscope`` (``snapshot_download`` of ``cosyvoice.cli.cosyvoice``, for a model name)."""
    for name, attrs in (("whisper", {"log_mel_spectrogram": None}), ("whisper.tokenizer", {"Tokenizer": object}),
                        ("tiktoken", {"Encoding": object}), ("modelscope", {"snapshot_download": None})):
        if name in sys.modules or not (name.startswith("whisper") or importlib.util.find_spec(name) is None):
            continue
        module = _stub(name, **attrs)
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(sys.modules[parent], child, module)


@contextlib.contextmanager
def injected_multinomial(draws: Iterator[float]):
    """Replace ``Tensor.multinomial`` / ``torch.multinomial`` (one sample from a 1-D tensor: what the official
    samplers call) by :func:`~cosyvoice_triton.models.sampling.pick` on the next of ``draws``, the uniforms the
    library's LM takes through ``draws=``: both sides then sample the same tokens from the same weights."""
    from ..models.sampling import pick

    original_method, original_fn = torch.Tensor.multinomial, torch.multinomial

    def multinomial(probs, num_samples, replacement=False, *, generator=None, out=None):
        if num_samples != 1 or probs.dim() != 1:
            raise RuntimeError(f"draw injection handles one sample from a 1-D tensor, got {num_samples} from "
                               f"{tuple(probs.shape)}")
        return torch.tensor([pick(probs, next(draws))], dtype=torch.long, device=probs.device)

    torch.Tensor.multinomial = torch.multinomial = multinomial
    try:
        yield
    finally:
        torch.Tensor.multinomial, torch.multinomial = original_method, original_fn


def seed_causal_hift_noise(hift: torch.nn.Module, seed: int = 0) -> None:
    """Redraw the noise buffers of an official ``CausalHiFTGenerator`` as its constructor draws them, from a
    generator seeded with ``seed`` instead of torch's global one (whose state depends on what was built before):
    it then holds the library's ``hift_noise_seed=seed`` noise."""
    sine = hift.m_source.l_sin_gen
    g = torch.Generator().manual_seed(seed)
    sine.rand_ini = torch.rand(1, 9, generator=g)
    sine.rand_ini[:, 0] = 0
    sine.sine_waves = torch.rand(tuple(sine.sine_waves.shape), generator=g)
    hift.m_source.uv = torch.rand(tuple(hift.m_source.uv.shape), generator=g)


class _NoLLM(torch.nn.Module):
    """The LM slot of the official ``CosyVoice2Model`` for token-to-waveform only (its constructor only keeps it)."""


def official_vc_model(checkout: str | Path, model_dir: str | Path):
    """The official ``CosyVoice2Model`` with the flow and HiFT of ``model_dir`` (built as its cosyvoice2.yaml
    builds them, weights loaded strictly as ``CosyVoice2Model.load`` does), in eval mode on the CPU; no LM.
    Needs the official flow/HiFT dependencies (diffusers, einops, conformer, omegaconf) importable."""
    from ..config import ModelConfig

    model_mod, flow_mod, cfm_mod, dec_mod, enc_mod, gen_mod, f0_mod = import_official(
        checkout, "cosyvoice.cli.model", "cosyvoice.flow.flow", "cosyvoice.flow.flow_matching",
        "cosyvoice.flow.decoder", "cosyvoice.transformer.upsample_encoder", "cosyvoice.hifigan.generator",
        "cosyvoice.hifigan.f0_predictor")
    from omegaconf import DictConfig

    model_dir = Path(model_dir)
    cfg = ModelConfig.from_yaml(model_dir / "cosyvoice2.yaml")
    f, e, est, h = cfg.flow, cfg.flow.encoder, cfg.flow.estimator, cfg.hift
    encoder = enc_mod.UpsampleConformerEncoder(
        output_size=e.output_size, attention_heads=e.attention_heads, linear_units=e.linear_units,
        num_blocks=e.num_blocks, dropout_rate=0.1, positional_dropout_rate=0.1, attention_dropout_rate=0.1,
        normalize_before=True, input_layer="linear", pos_enc_layer_type="rel_pos_espnet",
        selfattention_layer_type="rel_selfattn", input_size=e.input_size, use_cnn_module=False, macaron_style=False,
        static_chunk_size=e.static_chunk_size)
    estimator = dec_mod.CausalConditionalDecoder(
        in_channels=est.in_channels, out_channels=est.out_channels, channels=list(est.channels), dropout=0.0,
        attention_head_dim=est.attention_head_dim, n_blocks=est.n_blocks, num_mid_blocks=est.num_mid_blocks,
        num_heads=est.num_heads, act_fn="gelu", static_chunk_size=est.static_chunk_size,
        num_decoding_left_chunks=est.num_decoding_left_chunks)
    cfm_params = DictConfig({"sigma_min": 1e-06, "solver": "euler", "t_scheduler": cfg.flow.cfm.t_scheduler,
                             "training_cfg_rate": 0.2, "inference_cfg_rate": cfg.flow.cfm.inference_cfg_rate,
                             "reg_loss_type": "l1"})
    decoder = cfm_mod.CausalConditionalCFM(in_channels=240, n_spks=1, spk_emb_dim=80, cfm_params=cfm_params,
                                           estimator=estimator)
    flow = flow_mod.CausalMaskedDiffWithXvec(
        input_size=f.input_size, output_size=f.output_size, spk_embed_dim=f.spk_embed_dim, output_type="mel",
        vocab_size=f.vocab_size, input_frame_rate=cfg.token_frame_rate, only_mask_loss=True,
        token_mel_ratio=f.token_mel_ratio, pre_lookahead_len=f.pre_lookahead_len, encoder=encoder, decoder=decoder)
    hift = gen_mod.HiFTGenerator(
        in_channels=h.in_channels, base_channels=h.base_channels, nb_harmonics=h.nb_harmonics,
        sampling_rate=h.sampling_rate, nsf_alpha=h.nsf_alpha, nsf_sigma=h.nsf_sigma,
        nsf_voiced_threshold=h.nsf_voiced_threshold, upsample_rates=list(h.upsample_rates),
        upsample_kernel_sizes=list(h.upsample_kernel_sizes), istft_params={"n_fft": h.n_fft, "hop_len": h.hop_len},
        resblock_kernel_sizes=list(h.resblock_kernel_sizes),
        resblock_dilation_sizes=[list(d) for d in h.resblock_dilation_sizes],
        source_resblock_kernel_sizes=list(h.source_resblock_kernel_sizes),
        source_resblock_dilation_sizes=[list(d) for d in h.source_resblock_dilation_sizes],
        lrelu_slope=h.lrelu_slope, audio_limit=h.audio_limit,
        f0_predictor=f0_mod.ConvRNNF0Predictor(num_class=h.f0_predictor.num_class,
                                               in_channels=h.f0_predictor.in_channels,
                                               cond_channels=h.f0_predictor.cond_channels))
    model = model_mod.CosyVoice2Model(_NoLLM(), flow, hift)
    flow.load_state_dict(torch.load(model_dir / "flow.pt", map_location="cpu", weights_only=True), strict=True)
    state = torch.load(model_dir / "hift.pt", map_location="cpu", weights_only=True)
    hift.load_state_dict({k.replace("generator.", ""): v for k, v in state.items()}, strict=True)
    flow.eval()
    hift.eval()
    return model


def official_qwen2lm(checkout: str | Path, qwen: str | Path | torch.nn.Module, *, hidden_size: int,
                     speech_token_size: int = 6561):
    """The official ``Qwen2LM`` as cosyvoice2.yaml builds it, in eval mode.

    ``qwen``: a ``CosyVoice-BlankEN`` folder with a config and weights (the official ``Qwen2Encoder`` calls
    ``from_pretrained`` on it), or an already built official ``Qwen2Encoder``.
    """
    llm, common = import_official(checkout, "cosyvoice.llm.llm", "cosyvoice.utils.common")
    encoder = qwen if isinstance(qwen, torch.nn.Module) else llm.Qwen2Encoder(str(qwen))
    model = llm.Qwen2LM(llm_input_size=hidden_size, llm_output_size=hidden_size, speech_token_size=speech_token_size,
                        llm=encoder, sampling=partial(common.ras_sampling, **OFFICIAL_SAMPLING),
                        length_normalized_loss=True, lsm_weight=0, mix_ratio=[5, 15])
    return model.eval()
