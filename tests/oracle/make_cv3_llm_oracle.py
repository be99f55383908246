"""Regenerate the CosyVoice3 LM oracle (tests/fixtures/cv3_llm_oracle) from a checkout of the official code.

    python tests/oracle/make_cv3_llm_oracle.py --official /tmp/cosyvoice_official --out DIR \
        --official-commit ace7c47f41bbd303aa6bf1ea80e6f9fbd595cd40

Writes, in the official layout, a random ``llm.pt`` and ``CosyVoice-BlankEN/`` (Qwen2 ``config.json`` and the
``model.safetensors`` the official ``Qwen2Encoder.from_pretrained`` reads) at tiny dims, and a ``cosyvoice3.yaml``
whose ``llm:`` section is the official one at those dims. It builds the official ``CosyVoice3LM`` from that yaml
with HyperPyYAML, loads ``llm.pt`` strictly (``weights_only``) and checks the loaded state's digest, then records:

- ``lm_<case>.npz``: the official ``inference`` with every ``multinomial`` draw replaced by ``pick`` on injected
  uniforms (make_llm_oracle's rule), and what the official ``CosyVoice3Model.llm_job`` passes on to the flow (its
  silent-token filter) for the same draws;
- ``bistream_<case>.npz``: the official ``inference_bistream`` the same way.

The text vocabulary is Qwen2.5's 151936 ids (the official code hard-codes ``<|endofprompt|>`` = 151646), so
``llm.pt`` is ~20 MB: it is not committed. Its weights are seeded draws only (:func:`random_cv3_llm_state_dict`);
the tests regenerate them and check ``state_sha256`` of the meta. See tests/oracle/cosyvoice3_llm.md.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_llm_oracle as cv2_oracle  # noqa: E402  (pick, injected draws, digests, the official bistream runner)
from oracle_common import oracle_parser  # noqa: E402

SPEECH_TOKEN_SIZE = 6561
SPECIAL_ROWS = 200  # CosyVoice3LM: speech_embedding / llm_decoder have speech_token_size + 200 rows
SOS, EOS, TASK_ID, FILL = (SPEECH_TOKEN_SIZE + i for i in range(4))
ENDOFPROMPT = 151646
SILENT_TOKENS = [1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323]
WEIGHT_SEED = 20251202
INPUT_SEED = 5151
LOGP_STEPS = 8
BISTREAM_LOGP_STEPS = 4

# Tiny Qwen2 as the CosyVoice2 oracle's (hidden 32, 3 layers, GQA 4:2, tied embeddings), with Qwen2.5's vocabulary.
QWEN_TINY = {**cv2_oracle.QWEN_TINY, "vocab_size": cv2_oracle.QWEN_FULL["vocab_size"]}

# CosyVoice3's llm_decoder has no bias. A bias is carried by hidden dimension 0 instead: that column of every input
# embedding row is set to BIAS_FEATURE, and no layer reads or writes dimension 0 (column 0 of the q/k/v/gate/up
# projections and row 0 of o_proj / down_proj are zero), so the last hidden state holds BIAS_FEATURE there exactly and
# the final RMSNorm turns it into h[0] ~ BIAS_H0 (the other dimensions only change the norm a little).
# llm_decoder.weight[:, 0] = bias / BIAS_H0 then acts as a per-token logit offset. Offsets: end-of-speech EOS_BIAS,
# sos (the id the official sampling_ids masks before min_len) SOS_BIAS, the other 198 stop ids STOP_BIAS, the silent
# tokens and a few random speech ids FAVOURITE_BIAS (the nucleus repeats them: the repetition fallback runs and runs
# of silent tokens occur).
BIAS_FEATURE = 8.0
BIAS_H0 = 3.5
LOGIT_STD = 2.5
EOS_BIAS = 4.0
SOS_BIAS = 3.0
STOP_BIAS = 0.0
FAVOURITES = 4
FAVOURITE_BIAS = 5.0

# (name, mode, [system prompt, rest] prompt text lengths, text length, prompt speech count, aim).
# Layouts as the official front end feeds the CosyVoice3 LM (example.py): zero_shot: prompt text = system prompt +
# <|endofprompt|> + transcript, prompt speech tokens; cross_lingual: no prompts, the text starts with system prompt +
# <|endofprompt|>; instruct (inference_instruct2): prompt text = instruction ending in <|endofprompt|>, no prompt
# speech tokens. aim (stop id, first step): the first full-distribution draw (the repetition fallback) at or after that
# step (None: min_len) is aimed at that stop id.
CASES = [
    ("zero_shot_a", "zero_shot", (5, 4), 7, 20, None),
    ("zero_shot_b", "zero_shot", (6, 8), 13, 37, None),
    ("zero_shot_one", "zero_shot", (5, 3), 1, 11, None),
    ("cross_lingual", "cross_lingual", (5, 0), 10, 0, None),
    ("instruct", "instruct", (9, 0), 8, 0, None),
    ("zero_shot_other_stop", "zero_shot", (5, 5), 9, 15, (SPEECH_TOKEN_SIZE + 57, None)),
    # end-of-speech before min_len: the official code masks sos (speech_token_size) there, not end-of-speech
    ("zero_shot_early_eos", "zero_shot", (4, 6), 12, 18, (EOS, 2)),
]
# (name, mode, text chunk sizes, [system, rest] prompt text lengths, prompt speech count). inference_bistream needs
# <|endofprompt|> in the prompt text (it asserts so): a CosyVoice3 cross-lingual bistream (no prompt text) raises.
BISTREAM_CASES = [
    ("bistream_runout", "zero_shot", [1] * 24, (5, 5), 20),
    ("bistream_left", "zero_shot", [1] * 8, (5, 4), 60),
    ("bistream_instruct", "instruct", [1] * 13, (7, 0), 0),
    ("bistream_chunks", "zero_shot", [7, 1, 12, 3, 9, 2], (5, 5), 23),
]


def write_blank_en(folder: Path, state: dict[str, torch.Tensor] | None) -> None:
    """``config.json`` (tiny dims) and, with ``state``, the ``model.safetensors`` ``from_pretrained`` reads."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN_TINY, indent=2) + "\n")
    if state is not None:
        qwen = {k.removeprefix("llm.model."): v.contiguous() for k, v in state.items()
                if k.startswith("llm.model.") and k != "llm.model.lm_head.weight"}
        save_file(qwen, str(folder / "model.safetensors"), metadata={"format": "pt"})


def write_yaml(path: Path, hidden: int) -> None:
    """A ``cosyvoice3.yaml`` holding the fixed params and the ``llm:`` section of the official
    examples/libritts/cosyvoice3/conf/cosyvoice3.yaml, with ``hidden`` as llm_input_size / llm_output_size
    (:func:`check_yaml` compares it with the official file)."""
    path.write_text(f"""\
# The llm section of Fun-CosyVoice3's cosyvoice3.yaml at the tiny dims of the oracle (hidden {hidden}).
sample_rate: 24000
llm_input_size: {hidden}
llm_output_size: {hidden}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2

llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: {SPEECH_TOKEN_SIZE}
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1
""")


def check_yaml(official: Path, ours: Path) -> None:
    """The llm section of ``ours`` equals the official example's, sizes aside (both read without executing tags)."""
    from cosyvoice_triton.config import load_hyperpyyaml

    official_doc = load_hyperpyyaml((official / "examples/libritts/cosyvoice3/conf/cosyvoice3.yaml").read_text())
    our_doc = load_hyperpyyaml(ours.read_text())
    a, b = dict(official_doc["llm"]), dict(our_doc["llm"])
    for doc in (a, b):
        doc.pop("llm_input_size"), doc.pop("llm_output_size")
    if a != b:
        raise AssertionError(f"the oracle's llm section differs from the official yaml's: {a} vs {b}")


def random_cv3_llm_state_dict(config: dict, *, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights in the official CosyVoice3 ``llm.pt`` format (float32; draws and elementwise scaling
    only, so they regenerate bit for bit). Keys: ``llm.model.*`` (the tied ``lm_head`` shares ``embed_tokens``),
    ``llm_decoder.weight`` [S+200, H] (no bias), ``speech_embedding.weight`` [S+200, H].

    Qwen2 tensors as :func:`make_llm_oracle.random_llm_state_dict` draws them (embeddings N(0,1), linear weights
    N(0, 1/fan_in), q/k/v biases 0.02 N, RMSNorm weights 1 + 0.1 N); then the bias dimension (see BIAS_FEATURE).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        qwen = Qwen2ForCausalLM(Qwen2Config(**config))
    hidden, n_out = config["hidden_size"], SPEECH_TOKEN_SIZE + SPECIAL_ROWS
    shapes = {f"llm.model.{k}": tuple(v.shape) for k, v in qwen.state_dict().items()}
    shapes.update({"llm_decoder.weight": (n_out, hidden), "speech_embedding.weight": (n_out, hidden)})
    gen = torch.Generator().manual_seed(seed)
    tied = "llm.model.lm_head.weight" if config.get("tie_word_embeddings") else None
    state: dict[str, torch.Tensor] = {}
    for key in sorted(shapes):
        if key == tied:
            continue
        shape = shapes[key]
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if key == "llm_decoder.weight":
            x *= LOGIT_STD / (hidden - 1) ** 0.5
            bias = torch.zeros(n_out)
            bias[SOS] = SOS_BIAS
            bias[EOS] = EOS_BIAS
            bias[SOS + 2 :] = STOP_BIAS
            bias[SILENT_TOKENS] = FAVOURITE_BIAS
            bias[torch.randperm(SPEECH_TOKEN_SIZE, generator=gen)[:FAVOURITES]] = FAVOURITE_BIAS
            x[:, 0] = bias / BIAS_H0
        elif key.endswith(("embedding.weight", "embed_tokens.weight")):
            x[:, 0] = BIAS_FEATURE
        elif key.endswith("norm.weight"):
            x = 1.0 + 0.1 * x
        elif key.endswith(".bias"):
            x *= 0.02
        elif len(shape) == 2:
            x /= shape[1] ** 0.5
            if key.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
                x[:, 0] = 0.0  # reads no dimension 0
            elif key.endswith(("o_proj.weight", "down_proj.weight")):
                x[0, :] = 0.0  # writes no dimension 0
            else:
                raise AssertionError(f"no rule for {key} {shape}")
        else:
            raise AssertionError(f"no rule for {key} {shape}")
        state[key] = x
    if tied:
        state[tied] = state["llm.model.model.embed_tokens.weight"]
    return {k: state[k] for k in shapes}


def write_model(out: Path) -> dict[str, torch.Tensor]:
    state = random_cv3_llm_state_dict(QWEN_TINY, seed=WEIGHT_SEED)
    torch.save(state, out / "llm.pt")
    write_blank_en(out / "CosyVoice-BlankEN", state)
    write_yaml(out / "cosyvoice3.yaml", QWEN_TINY["hidden_size"])
    return state


def build_official(official: Path, out: Path):
    """The official ``CosyVoice3Model`` (LM only) with the ``CosyVoice3LM`` the yaml's llm section builds
    (HyperPyYAML, ``qwen_pretrain_path`` = the folder's CosyVoice-BlankEN), ``llm.pt`` loaded strictly."""
    from hyperpyyaml import load_hyperpyyaml

    from cosyvoice_triton.bench.official import import_official

    (model_mod,) = import_official(official, "cosyvoice.cli.model")
    with open(out / "cosyvoice3.yaml") as f:
        configs = load_hyperpyyaml(f, overrides={"qwen_pretrain_path": str(out / "CosyVoice-BlankEN")})
    llm = configs["llm"]
    if type(llm).__name__ != "CosyVoice3LM":
        raise AssertionError(f"the yaml built {type(llm).__name__}")
    model = model_mod.CosyVoice3Model(llm, cv2_oracle._NoModule(), cv2_oracle._NoModule())
    model.llm.load_state_dict(torch.load(out / "llm.pt", map_location="cpu", weights_only=True), strict=True)
    model.llm.eval()
    return model


# ------------------------------------------------------------------------------------------- references
def text_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random ordinary text ids (below Qwen2's special tokens, so never <|endofprompt|>)."""
    return rng.integers(0, 151643, size=n).astype(np.int32)


def lm_inputs(rng, mode: str, prompt_parts: tuple[int, int], n_text: int, n_speech: int):
    """(text, prompt_text, prompt_speech) in the layout of ``mode``."""
    system = np.concatenate([text_ids(rng, prompt_parts[0]), np.int32([ENDOFPROMPT])])
    rest = text_ids(rng, prompt_parts[1])
    text = text_ids(rng, n_text)
    speech = rng.integers(0, SPEECH_TOKEN_SIZE, size=n_speech).astype(np.int32)
    if mode == "cross_lingual":
        return np.concatenate([system, text]), np.zeros(0, np.int32), speech[:0]
    if mode == "instruct":
        return text, system, speech[:0]
    return text, np.concatenate([system, rest]), speech


def aimed_draws(draws: np.ndarray, target: int | None, from_step: int):
    """(an iterator over ``draws`` that, when ``target`` is set, replaces the first full-distribution draw of a step
    >= from_step by the midpoint of ``target``'s CDF interval; the list of draws used; a ``before`` hook)."""
    state = {"step": 0, "aimed": target is None}
    used: list[float] = []
    plain = iter(draws.tolist())
    pending: list[float] = []

    class Draws:
        def __iter__(self):
            return self

        def __next__(self):
            u = pending.pop() if pending else next(plain)
            used.append(u)
            return u

    def before(probs):
        if state["aimed"] or probs.numel() != SPEECH_TOKEN_SIZE + SPECIAL_ROWS or state["step"] < from_step:
            return
        c = torch.cumsum(probs.detach().flatten().to(torch.float64), 0)
        u = (float(c[target - 1]) + float(c[target])) / 2 / float(c[-1])
        if cv2_oracle.pick(probs, u) != target:
            raise AssertionError(f"cannot aim a draw at {target}")
        state["aimed"] = True
        pending.append(u)

    return Draws(), used, before, state


def run_official_lm(model, text, prompt_text, prompt_speech, draws: np.ndarray, target: int | None,
                    from_step: int) -> dict:
    """One official ``CosyVoice3LM.inference`` (through ``CosyVoice3Model.llm_job``, which also applies the silent
    token filter) with injected draws; what each step saw, drew and yielded."""
    llm = model.llm
    steps: list[dict] = []
    raw: list[int] = []
    original = llm.sampling_ids
    source, used, before, state = aimed_draws(draws, target, from_step)

    def sampling_ids(weighted_scores, decoded_tokens, sampling, ignore_eos=True):
        state["step"] = len(decoded_tokens)
        steps.append({"logp": weighted_scores.detach().clone(), "ignore_eos": bool(ignore_eos), "n_draws": len(used)})
        steps[-1]["sampled"] = top = original(weighted_scores, decoded_tokens, sampling, ignore_eos=ignore_eos)
        return top

    original_inference = llm.inference

    def inference(**kwargs):
        for token in original_inference(**kwargs):
            raw.append(int(token))
            yield token

    t = lambda a: torch.as_tensor(a, dtype=torch.int32)[None]
    log: list = []
    llm.sampling_ids = sampling_ids
    llm.inference = inference
    uuid = "oracle"
    model.tts_speech_token_dict[uuid] = []
    start = time.perf_counter()
    try:
        with cv2_oracle.injected_multinomial(source, log, before=before):
            model.llm_job(t(text), t(prompt_text), t(prompt_speech), torch.zeros(1, 0), uuid)
    finally:
        del llm.sampling_ids, llm.inference
    seconds = time.perf_counter() - start
    if target is not None and not state["aimed"]:
        raise AssertionError(f"no full-distribution draw at or after step {from_step} to aim at {target}")
    kept = model.tts_speech_token_dict.pop(uuid)
    sampled = np.asarray([s["sampled"] for s in steps], np.int32)
    if not np.array_equal(sampled[: len(raw)], raw):
        raise AssertionError("inference() yielded other tokens than its sampling steps picked")
    stop = -1 if len(steps) == len(raw) else int(sampled[-1])
    bounds = [s["n_draws"] for s in steps] + [len(used)]
    return {
        "tokens": np.asarray(raw, np.int32), "llm_job_tokens": np.asarray(kept, np.int32),
        "n_steps": np.int32(len(steps)), "stop_token": np.int32(stop), "draws": np.asarray(used, np.float64),
        "step_draws": np.diff(bounds).astype(np.int32), "draws_used": np.int32(len(used)),
        "logp": torch.stack([s["logp"] for s in steps[:LOGP_STEPS]]).float().numpy(),
        "ignore_eos": np.asarray([s["ignore_eos"] for s in steps], bool), "seconds": seconds,
    }


def make_lm_references(model, out: Path) -> dict:
    rng = np.random.default_rng(INPUT_SEED)
    summary = {}
    for i, (name, mode, parts, n_text, n_speech, aim) in enumerate(CASES):
        text, prompt_text, prompt_speech = lm_inputs(rng, mode, parts, n_text, n_speech)
        min_len, max_len = int(len(text) * 2), int(len(text) * 20)
        draws = cv2_oracle.case_draws(INPUT_SEED + 1 + i, 2 * max_len + 2)
        target, from_step = aim if aim is not None else (None, 0)
        from_step = min_len if from_step is None else from_step
        r = run_official_lm(model, text, prompt_text, prompt_speech, draws, target, from_step)
        seconds = r.pop("seconds")
        np.savez_compressed(out / f"lm_{name}.npz", mode=np.array(mode), text=text, prompt_text=prompt_text,
                            prompt_speech_token=prompt_speech, min_len=np.int32(min_len), max_len=np.int32(max_len),
                            target=np.int32(-1 if target is None else target), **r)
        tokens, stop = r["tokens"], int(r["stop_token"])
        summary[name] = {
            "mode": mode, "text_len": len(text), "prompt_text_len": len(prompt_text),
            "prompt_speech_len": len(prompt_speech), "min_len": min_len, "max_len": max_len,
            "tokens": len(tokens), "llm_job_tokens": len(r["llm_job_tokens"]),
            "silent_tokens": int(np.isin(tokens, SILENT_TOKENS).sum()), "steps": int(r["n_steps"]),
            "draws_used": int(r["draws_used"]), "fallback_draws": int((r["step_draws"] == 2).sum()),
            "ended_by": "max_len" if stop < 0 else f"stop token {stop} ({'eos' if stop == EOS else 'other'})"
                        + (" before min_len" if stop >= 0 and len(tokens) < min_len else ""),
            "aimed_at": None if target is None else [target, from_step], "seconds": round(seconds, 3)}
        print(f"  {name}: {summary[name]}", flush=True)
    return summary


def make_bistream_references(model, out: Path) -> dict:
    rng = np.random.default_rng(INPUT_SEED + 300)
    summary = {}
    for i, (name, mode, sizes, parts, n_speech) in enumerate(BISTREAM_CASES):
        text, prompt_text, prompt_speech = lm_inputs(rng, mode, parts, sum(sizes), n_speech)
        bounds = np.cumsum([0, *sizes])
        chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
        draws = cv2_oracle.case_draws(INPUT_SEED + 400 + i, 4000)
        start = time.perf_counter()
        r = cv2_oracle.run_official_bistream(model.llm, chunks, prompt_text, prompt_speech, draws, None)
        seconds = time.perf_counter() - start
        r["logp"] = r["logp"][:BISTREAM_LOGP_STEPS]
        np.savez_compressed(out / f"{name}.npz", mode=np.array(mode), text=text,
                            chunk_sizes=np.asarray(sizes, np.int32), prompt_text=prompt_text,
                            prompt_speech_token=prompt_speech, **r)
        summary[name] = {"mode": mode, "text_len": int(sum(sizes)), "chunks": len(sizes),
                         "prompt_text_len": len(prompt_text), "prompt_speech_len": n_speech,
                         "tokens": len(r["tokens"]), "sampled_steps": len(r["sampled"]),
                         "fills": int((r["sampled"] == FILL).sum()), "draws_used": int(r["draws_used"]),
                         "ended_by": r["error"].item() or "eos", "seconds": round(seconds, 3)}
        print(f"  {name}: {summary[name]}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = oracle_parser(__doc__)
    ap.add_argument("--keep-weights", action="store_true", help="keep llm.pt and model.safetensors in --out")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE.parents[1]))  # the project, for cosyvoice_triton.bench.official
    torch.set_num_threads(max(1, torch.get_num_threads()))
    args.out.mkdir(parents=True, exist_ok=True)
    for old in itertools.chain(args.out.glob("lm_*.npz"), args.out.glob("bistream_*.npz")):
        old.unlink()
    timings = {}

    print("random llm.pt + CosyVoice-BlankEN + cosyvoice3.yaml", flush=True)
    start = time.perf_counter()
    state = write_model(args.out)
    check_yaml(args.official, args.out / "cosyvoice3.yaml")
    digest = cv2_oracle.state_digest(state)
    n_params = sum(v.numel() for k, v in state.items() if k != "llm.model.lm_head.weight")
    del state
    timings["write weights"] = round(time.perf_counter() - start, 3)

    print("official CosyVoice3LM (HyperPyYAML) + strict load", flush=True)
    start = time.perf_counter()
    model = build_official(args.official, args.out)
    timings["official build + strict load"] = round(time.perf_counter() - start, 3)
    if cv2_oracle.state_digest(dict(model.llm.state_dict())) != digest:
        raise AssertionError("the official model does not hold the written llm.pt after the strict load")

    print("CosyVoice3LM.inference references (through CosyVoice3Model.llm_job)", flush=True)
    lm = make_lm_references(model, args.out)
    print("CosyVoice3LM.inference_bistream references", flush=True)
    bistream = make_bistream_references(model, args.out)
    if not args.keep_weights:
        (args.out / "llm.pt").unlink()
        (args.out / "CosyVoice-BlankEN" / "model.safetensors").unlink()

    from cosyvoice_triton.bench.official import OFFICIAL_SAMPLING, OFFICIAL_TOKEN_TEXT_RATIO, STUBBED

    meta = {"versions": cv2_oracle._versions(args.official, args.official_commit), "stubbed_modules": STUBBED,
            "seeds": {"weights": WEIGHT_SEED, "inputs": INPUT_SEED},
            "weights": {"logit_std": LOGIT_STD, "bias_feature": BIAS_FEATURE, "bias_h0": BIAS_H0, "eos_bias": EOS_BIAS,
                        "sos_bias": SOS_BIAS, "stop_bias": STOP_BIAS, "favourites": FAVOURITES,
                        "favourite_bias": FAVOURITE_BIAS, "params": n_params, "state_sha256": digest},
            "qwen_config": QWEN_TINY, "speech_token_size": SPEECH_TOKEN_SIZE, "special_rows": SPECIAL_ROWS,
            "endofprompt": ENDOFPROMPT, "silent_tokens": SILENT_TOKENS, "sampling": OFFICIAL_SAMPLING,
            "token_text_ratio": OFFICIAL_TOKEN_TEXT_RATIO, "logp_steps": LOGP_STEPS,
            "bistream_logp_steps": BISTREAM_LOGP_STEPS, "lm_cases": lm, "bistream_cases": bistream,
            "timings_s": timings}
    (args.out / "oracle_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
