#!/usr/bin/env python3
"""Differential probe of opd's model loading and numerics against Hugging Face transformers.

For each case below this builds a tiny random model with transformers (seeded; weights drawn
large enough that logits are spread, so greedy decoding has no near-ties), saves it with
save_pretrained (safetensors; some cases in bf16/f16, sharded, or with config.json edited
afterwards: fields removed, unknown values), then compares opd's CLI with transformers
loading the *same directory* (from_pretrained, f64 and f32 on the CPU):

  info      `opd info DIR --json` loads, num_parameters == model.num_parameters(), and its
            eos_token_ids / bos_token_id equal model.config's (class defaults included)
  score     `opd score --top-k V` (the full next-token distribution at every position) against
            log_softmax of transformers' f64 logits: max |diff| / max(1, |ref|) <= 1e-4
  generate  `opd generate --temperature 0 --max-new-tokens 16` against
            model.generate(do_sample=False) token for token (same EOS stop); at a divergence
            the f64 logit gap between the two tokens is reported (< 1e-3: a near-tie, not a bug)
  train     (--train) `opd sft` one step on a token-id dataset, then the exported checkpoint
            loaded with transformers: from_pretrained must work without missing/unexpected
            keys and give opd's log-probabilities (`opd score` on the checkpoint)

Outcomes per case: MATCH; REFUSED (opd stopped at load; "clear" when the message names the
field or architecture the case varies, listed in the case's `mention`); HF-REFUSES
(transformers cannot load it either; opd must refuse too); MISMATCH (opd loaded and computed
something else: the bug this probe hunts); ERROR (a crash or an unclear message).
A case marked expect="refuse" passes only as a clear refusal, expect="match" only as MATCH.

Usage:
  python3 tools/probe_configs.py [--opd build/opd] [--seed 0] [--only SUBSTR ...]
                                 [--train] [--keep DIR] [--json OUT.json] [--list]
Needs torch, transformers (5.x), safetensors; CPU only; ~1-2 minutes for all cases on 2 cores
(--train adds one `opd sft` per family case). Exit status 1 when any case fails its expectation.
Reviewers: change --seed to draw other weights and prompts; add cases to CASES.
"""
import argparse
import copy
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

try:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
except ImportError as e:  # the probe is an oracle tool: without transformers there is nothing to do
    print(f"probe_configs: skipped ({e})")
    sys.exit(0)

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

# ---------------------------------------------------------------------------------------------
# Cases. `cfg` are config kwargs (on top of the family base); `edit` changes config.json after
# save_pretrained (a dict: value None deletes the key); `dtype` is the dtype written to disk.
# ---------------------------------------------------------------------------------------------
BASE = dict(vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)

FAMILY = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "gemma": dict(architectures=["GemmaForCausalLM"], model_type="gemma", head_dim=16),
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", pad_token_id=0),
    "qwen2_moe": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
}


def case(name, family, cfg=None, edit=None, dtype="float32", shard=None, prompt_len=40,
         expect="match", mention=(), note="", gen_eos=None, known=None, files=None):
    """gen_eos: "generation_config" puts a token transformers' greedy output reaches at step 4
    into generation_config.json's eos_token_id (config.json keeps its own); "config" puts it
    into config.json and gives generation_config.json another one. known: an accepted,
    documented difference (docs/robustness.md): a MISMATCH then counts as KNOWN. files:
    callable(model_dir) run after saving (edits safetensors, removes files)."""
    return dict(name=name, family=family, cfg=cfg or {}, edit=edit or {}, dtype=dtype,
                shard=shard, prompt_len=prompt_len, expect=expect, mention=list(mention),
                note=note, gen_eos=gen_eos, known=known, files=files)


L3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
          original_max_position_embeddings=32)
CASES = [
    # --- Llama ---
    case("llama_gqa", "llama"),
    case("llama_mha_tied", "llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    case("llama_mqa", "llama", dict(num_key_value_heads=1)),
    case("llama_head_dim_24", "llama", dict(head_dim=24), note="head_dim != hidden/heads"),
    case("llama_hidden_not_divisible", "llama", dict(hidden_size=66, head_dim=16),
         expect="refuse", mention=["num_attention_heads", "hidden_size"],
         note="LlamaConfig.validate_architecture refuses it too"),
    case("llama_attention_bias", "llama", dict(attention_bias=True)),
    case("llama_mlp_bias", "llama", dict(mlp_bias=True), expect="refuse", mention=["mlp_bias"]),
    case("llama_theta_500k", "llama", dict(rope_theta=500000.0)),
    case("llama_theta_small", "llama", dict(rope_theta=100.0)),
    case("llama_rope_llama3", "llama", dict(rope_scaling=L3), prompt_len=100),
    case("llama_rope_llama3_no_orig", "llama",
         dict(rope_scaling={k: v for k, v in L3.items() if k != "original_max_position_embeddings"},
              max_position_embeddings=48), prompt_len=40),
    case("llama_rope_linear", "llama", dict(rope_scaling=dict(rope_type="linear", factor=4.0)),
         prompt_len=100),
    case("llama_rope_linear_legacy_type", "llama",
         edit={"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_parameters": None}),
    case("llama_rope_llama3_toplevel_orig", "llama", dict(rope_scaling=L3), prompt_len=100,
         edit={"original_max_position_embeddings": 64},
         note="a top-level original_max_position_embeddings wins over the rope dict's in transformers"),
    case("llama_rope_llama3_partial_rotary", "llama", dict(rope_scaling=L3),
         edit={"partial_rotary_factor": 0.5}, expect="refuse", mention=["partial_rotary_factor"]),
    case("llama_rope_linear_partial_rotary", "llama",
         edit={"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                   "partial_rotary_factor": 0.5}},
         expect="refuse", mention=["partial_rotary_factor"]),
    case("llama_rope_dynamic", "llama", dict(rope_scaling=dict(rope_type="dynamic", factor=2.0),
                                             max_position_embeddings=32), prompt_len=40,
         expect="refuse", mention=["rope", "dynamic"]),
    case("llama_rope_yarn", "llama",
         dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
         prompt_len=100),
    case("llama_rope_yarn_attn_factor", "llama",
         dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                attention_factor=1.3, beta_fast=16.0, beta_slow=2.0)),
         prompt_len=100),
    case("llama_rope_longrope", "llama",
         dict(rope_scaling=dict(rope_type="longrope", original_max_position_embeddings=32,
                                short_factor=[1.0] * 8, long_factor=[2.0] * 8),
              max_position_embeddings=128),
         expect="refuse", mention=["rope", "longrope"]),
    case("llama_max_pos_48_prompt_40", "llama", dict(max_position_embeddings=48), prompt_len=40,
         note="generation runs past max_position_embeddings"),
    case("llama_eps_1e-2", "llama", dict(rms_norm_eps=1e-2)),
    case("llama_vocab_97", "llama", dict(vocab_size=97)),
    case("llama_vocab_1001", "llama", dict(vocab_size=1001)),
    case("llama_gelu", "llama", dict(hidden_act="gelu"), expect="refuse", mention=["hidden_act", "gelu"]),
    case("llama_swish", "llama", dict(hidden_act="swish"), note="ACT2FN['swish'] is SiLU"),
    case("llama_bf16", "llama", dtype="bfloat16"),
    case("llama_f16", "llama", dtype="float16"),
    case("llama_sharded", "llama", shard="40KB"),
    case("llama_eos_list", "llama", dict(eos_token_id=[2, 7, 9], bos_token_id=1)),
    case("llama_no_bos_eos", "llama", edit={"bos_token_id": None, "eos_token_id": None}),
    case("llama_fields_missing", "llama", dict(tie_word_embeddings=False),
         edit={"rms_norm_eps": None, "rope_parameters": None, "rope_theta": None,
               "max_position_embeddings": None, "head_dim": None, "hidden_act": None,
               "tie_word_embeddings": None, "attention_bias": None, "mlp_bias": None,
               "dtype": None, "torch_dtype": None, "architectures": None}),
    case("llama_pretraining_tp_2", "llama", edit={"pretraining_tp": 2}),
    case("llama_partial_rotary_default_rope", "llama",
         edit={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                   "partial_rotary_factor": 0.5}},
         note="LlamaRotaryEmbedding's default RoPE ignores partial_rotary_factor"),
    case("llama_f64", "llama", dtype="float64"),
    case("llama_tied_but_lm_head_stored", "llama", dict(tie_word_embeddings=False),
         edit={"tie_word_embeddings": True}, expect="refuse",
         mention=["tie_word_embeddings", "lm_head.weight"],
         note="an untied checkpoint declared tied: transformers 5 unties it (the stored values "
              "differ), transformers 4 and vLLM use the embedding"),
    case("llama_untied_lm_head_missing", "llama", dict(tie_word_embeddings=True),
         edit={"tie_word_embeddings": False}, expect="refuse", mention=["lm_head"]),
    case("llama_tied_only_lm_head_stored", "llama", dict(tie_word_embeddings=True),
         files=lambda d: rename_tensor(d, "model.embed_tokens.weight", "lm_head.weight"),
         expect="refuse", mention=["embed_tokens"],
         note="transformers 5 ties from whichever of the two is stored"),
    case("llama_eos_in_generation_config", "llama", gen_eos="generation_config"),
    case("llama_eos_in_config_only", "llama", gen_eos="config",
         known="opd stops at the union of config.json, generation_config.json and tokenizer EOS ids; "
               "transformers' generate only at generation_config.json's"),
    # --- Qwen2 ---
    case("qwen2_gqa", "qwen2"),
    case("qwen2_tied_mqa", "qwen2", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    case("qwen2_head_dim_24", "qwen2", dict(head_dim=24)),
    case("qwen2_hidden_not_divisible", "qwen2", dict(hidden_size=66, head_dim=16),
         note="heads do not divide hidden_size; head_dim given"),
    case("qwen2_sliding_window_off", "qwen2",
         dict(use_sliding_window=False, sliding_window=8, max_window_layers=1), prompt_len=40,
         note="transformers ignores sliding_window when use_sliding_window is false"),
    case("qwen2_sliding_window_on", "qwen2",
         dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), prompt_len=40,
         expect="refuse", mention=["sliding"]),
    case("qwen2_sliding_window_no_layer", "qwen2",
         dict(use_sliding_window=True, sliding_window=8, max_window_layers=2), prompt_len=40,
         note="max_window_layers >= num_hidden_layers: no layer slides"),
    case("qwen2_yarn_qwen25_style", "qwen2",
         edit={"rope_scaling": {"type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32}},
         prompt_len=100, note="the rope_scaling Qwen2.5 model cards recommend for long context"),
    case("qwen2_theta_1m_bf16_sharded", "qwen2", dict(rope_theta=1e6), dtype="bfloat16", shard="30KB"),
    case("qwen2_attention_bias_false_field", "qwen2", edit={"attention_bias": False},
         note="Qwen2 always has q/k/v biases; the field is ignored by transformers"),
    case("qwen2_kv_missing", "qwen2", dict(num_attention_heads=4, num_key_value_heads=4),
         edit={"num_key_value_heads": None}, expect="refuse", mention=["num_key_value_heads"],
         note="Qwen2Config's default is 32 key/value heads: transformers cannot load it"),
    case("qwen2_yarn_toplevel_orig_mscale", "qwen2",
         edit={"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                                "mscale": 0.7, "mscale_all_dim": 1.3, "beta_fast": 0, "truncate": False},
               "original_max_position_embeddings": 24},
         prompt_len=100),
    # --- Qwen3 ---
    case("qwen3_gqa", "qwen3"),
    case("qwen3_head_dim_32", "qwen3", dict(head_dim=32)),
    case("qwen3_mha_tied", "qwen3", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    case("qwen3_attention_bias", "qwen3", dict(attention_bias=True)),
    case("qwen3_rope_linear", "qwen3", dict(rope_scaling=dict(rope_type="linear", factor=3.0)),
         prompt_len=60),
    case("qwen3_rope_yarn", "qwen3",
         dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
         prompt_len=100),
    case("qwen3_f16_eos_list", "qwen3", dict(eos_token_id=[2, 5]), dtype="float16"),
    case("qwen3_sliding_window_on", "qwen3",
         dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
         expect="refuse", mention=["sliding"]),
    case("qwen3_head_dim_missing", "qwen3", dict(head_dim=128, hidden_size=64),
         edit={"head_dim": None}, note="Qwen3Config's default head_dim is 128"),
    case("qwen3_eps_1e-3_theta_1m", "qwen3", dict(rms_norm_eps=1e-3, rope_theta=1e6)),
    case("qwen3_model_type_only", "qwen3", edit={"architectures": None}),
    # --- other architectures: must be refused naming the architecture ---
    case("mistral", "mistral", expect="refuse", mention=["MistralForCausalLM"]),
    case("qwen3_moe", "qwen3_moe", expect="refuse", mention=["Qwen3MoeForCausalLM"]),
    case("qwen2_moe", "qwen2_moe", expect="refuse", mention=["Qwen2MoeForCausalLM"]),
    case("gemma", "gemma", expect="refuse", mention=["GemmaForCausalLM"]),
    case("phi3", "phi3", expect="refuse", mention=["Phi3ForCausalLM"]),
]

TRAIN_CASES = {"llama_gqa", "llama_mha_tied", "llama_head_dim_24", "llama_attention_bias",
               "llama_rope_llama3", "llama_rope_linear", "llama_rope_yarn", "llama_eos_list",
               "llama_bf16", "qwen2_gqa", "qwen2_tied_mqa", "qwen2_head_dim_24",
               "qwen2_yarn_qwen25_style", "qwen3_gqa", "qwen3_attention_bias", "qwen3_rope_yarn",
               "qwen3_head_dim_missing", "qwen3_f16_eos_list"}

TRAIN_VOCAB = 300  # --train cases: room for demo/tokenizer (257 ids), copied in for opd sft only
SCORE_TOL = 1e-4   # max |opd - ref| / max(1, |ref|) over all log-probabilities (opd computes in f32)
TIE_GAP = 1e-3     # a greedy divergence whose f64 logit gap is below this is a near-tie


# ---------------------------------------------------------------------------------------------
def randomize(model, gen):
    """Weights with spread logits: N(0, 1/fan_in) matrices, N(0,1) embeddings, norms ~ 1 +- 0.3,
    biases N(0, 0.3). transformers' default init (std 0.02) gives near-uniform outputs where
    greedy decoding is decided by rounding noise."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
            elif p.dim() == 2:
                scale = 2.0 if "lm_head" in name else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen, dtype=torch.float64)
                        / math.sqrt(p.shape[1]))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))


def rename_tensor(model_dir, old, new):
    from safetensors.torch import load_file, save_file
    path = os.path.join(model_dir, "model.safetensors")
    sd = load_file(path)
    sd[new] = sd.pop(old)
    save_file(sd, path, metadata={"format": "pt"})


def probe_ids(seed, vocab, length):
    """The scored sequence; its first length - 8 tokens are the generation prompt."""
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed + 7)).tolist()


def generation_prompt(seed, vocab, length):
    return probe_ids(seed, vocab, length)[:length - 8]


def build_model_dir(c, out_dir, seed, train=False):
    kwargs = dict(BASE)
    kwargs.update(FAMILY[c["family"]])
    kwargs.update(c["cfg"])
    if train:  # opd sft needs a tokenizer: demo/tokenizer's 257 ids must fit
        kwargs["vocab_size"] = max(kwargs["vocab_size"], TRAIN_VOCAB)
    archs = kwargs.pop("architectures")
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **kwargs)
    config.architectures = archs
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, torch.Generator().manual_seed(seed))
    if c["family"] in ("llama", "qwen2", "qwen3") and model.config.tie_word_embeddings:
        model.tie_weights()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "float64": torch.float64}[c["dtype"]]
    model = model.to(dtype)
    kw = {"max_shard_size": c["shard"]} if c["shard"] else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kw)
    if c["gen_eos"]:
        prompt = generation_prompt(seed, model.config.vocab_size, c["prompt_len"])
        n = len(prompt)
        with torch.no_grad():
            out = model.float().generate(torch.tensor([prompt]), attention_mask=torch.ones(1, n, dtype=torch.long),
                                         do_sample=False, max_new_tokens=8, eos_token_id=None,
                                         pad_token_id=0)[0, n:].tolist()
        # the latest first occurrence among the first 8 greedy tokens (random models repeat)
        stop = [t for i, t in enumerate(out) if t not in out[:i] and t != 2][-1]
        gpath = os.path.join(out_dir, "generation_config.json")
        with open(gpath) as f:
            g = json.load(f)
        if c["gen_eos"] == "generation_config":
            g["eos_token_id"] = [stop]
        else:
            g["eos_token_id"] = [2]
            c = dict(c, edit=dict(c["edit"], eos_token_id=stop))
        with open(gpath, "w") as f:
            json.dump(g, f, indent=2)
    if c["edit"]:
        path = os.path.join(out_dir, "config.json")
        with open(path) as f:
            j = json.load(f)
        for k, v in c["edit"].items():
            if v is None:
                j.pop(k, None)
            else:
                j[k] = v
        with open(path, "w") as f:
            json.dump(j, f, indent=2)
    if c["files"]:
        c["files"](out_dir)
    return model.config.vocab_size


def load_hf(model_dir, dtype):
    """from_pretrained with its loading report; None and the reason when transformers cannot
    load the directory faithfully (an exception, or weights it would initialize at random)."""
    try:
        model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                           output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - any failure means "transformers refuses"
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "mismatched_keys")}
    if bad:
        return None, f"loading report {json.dumps({k: sorted(map(str, v))[:3] for k, v in bad.items()})}"
    model.eval()
    return model, None


def run_opd(opd, args, timeout=300):
    p = subprocess.run([opd] + args, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def first_error_line(stderr):
    for line in stderr.splitlines():
        if "error" in line.lower() or "unsupported" in line.lower() or "invalid" in line.lower():
            return line.strip()
    lines = [l for l in stderr.splitlines() if l.strip()]
    return lines[-1].strip() if lines else ""


def opd_logprobs(opd, model_dir, ids, vocab, work):
    """[len(ids)-1, vocab] f64 from `opd score --top-k vocab` (rows are positions 1..T-1)."""
    inp = os.path.join(work, "score_in.jsonl")
    with open(inp, "w") as f:
        f.write(json.dumps({"ids": ids, "completion_start": 1}) + "\n")
    rc, out, err = run_opd(opd, ["score", "--model", model_dir, "--input", inp, "--top-k", str(vocab)])
    if rc != 0:
        return None, first_error_line(err)
    row = json.loads(out.strip().splitlines()[0])
    lp = torch.full((len(ids) - 1, vocab), float("nan"), dtype=torch.float64)
    for r, (tid, tlp) in enumerate(zip(row["ids"], row["logprobs"])):
        lp[r, torch.tensor(tid)] = torch.tensor(tlp, dtype=torch.float64)
    return lp, None


def hf_logprobs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].to(torch.float64)
    return torch.log_softmax(logits, dim=-1)[:-1], logits


def score_error(opd_lp, ref_lp):
    if torch.isnan(opd_lp).any():
        return float("inf")
    return float(((opd_lp - ref_lp).abs() / ref_lp.abs().clamp(min=1.0)).max())


def eos_ids(model):
    e = model.generation_config.eos_token_id
    if e is None:
        e = model.config.eos_token_id
    return [] if e is None else ([e] if isinstance(e, int) else list(e))


def compare_generation(opd, model_dir, model64, model32, prompt, work):
    rc, out, err = run_opd(opd, ["generate", "--model", model_dir, "--prompt-ids",
                                 ",".join(map(str, prompt)), "--temperature", "0",
                                 "--max-new-tokens", "16", "--json"])
    if rc != 0:
        return False, f"opd generate failed: {first_error_line(err)}"
    opd_new = json.loads(out)["results"][0]["samples"][0]["ids"]
    eos = eos_ids(model32)
    with torch.no_grad():
        gen = model32.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               do_sample=False, max_new_tokens=16, eos_token_id=eos or None,
                               pad_token_id=(eos[0] if eos else 0))
    hf_new = gen[0, len(prompt):].tolist()
    if eos and hf_new and hf_new[-1] in eos:
        pass
    if opd_new == hf_new:
        return True, f"{len(hf_new)} tokens identical"
    n = next((i for i in range(min(len(opd_new), len(hf_new))) if opd_new[i] != hf_new[i]),
             min(len(opd_new), len(hf_new)))
    if n >= len(opd_new) or n >= len(hf_new):
        return False, f"lengths differ: opd {len(opd_new)} tokens, transformers {len(hf_new)} (eos {eos})"
    with torch.no_grad():
        logits = model64(torch.tensor([prompt + hf_new[:n]])).logits[0, -1]
    gap = float(logits[hf_new[n]] - logits[opd_new[n]])
    if abs(gap) < TIE_GAP:
        return True, f"near-tie at new token {n}: gap {gap:.2e}"
    return False, f"diverges at new token {n}: opd {opd_new[n]}, transformers {hf_new[n]}, f64 logit gap {gap:.4g}"


def train_round_trip(opd, model_dir, vocab, ref_prompt, work, seed):
    data = os.path.join(work, "sft.jsonl")
    g = torch.Generator().manual_seed(seed + 1)
    with open(data, "w") as f:
        for _ in range(8):
            p = torch.randint(3, vocab, (12,), generator=g).tolist()
            cpl = torch.randint(3, vocab, (6,), generator=g).tolist()
            f.write(json.dumps({"prompt_ids": p, "completion_ids": cpl}) + "\n")
    run = os.path.join(work, "run")
    student = os.path.join(work, "student")  # the model plus a tokenizer, which opd sft needs
    shutil.copytree(model_dir, student)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(REPO, "demo", "tokenizer", f), student)
    rc, out, err = run_opd(opd, ["sft", "--student", student, "--data", data, "--out", run,
                                 "--max-steps", "1", "--batch-size", "4", "--micro-batch-size", "4",
                                 "--lr", "1e-2", "--save-steps", "1", "--no-tensorboard",
                                 "--no-eval-before", "--max-completion-length", "8"])
    if rc != 0:
        return False, f"opd sft failed: {first_error_line(err)}"
    ckpts = sorted(glob.glob(os.path.join(run, "checkpoints", "step-*")))
    if not ckpts:
        return False, "no checkpoint written"
    ck = ckpts[-1]
    model, why = load_hf(ck, torch.float64)
    if model is None:
        return False, f"transformers cannot load the checkpoint: {why}"
    ref_lp, _ = hf_logprobs(model, ref_prompt)
    lp, why = opd_logprobs(opd, ck, ref_prompt, vocab, work)
    if lp is None:
        return False, f"opd score on the checkpoint failed: {why}"
    err = score_error(lp, ref_lp)
    # the checkpoint must differ from the start (one step at lr 1e-2 moved the weights)
    base, _ = load_hf(model_dir, torch.float64)
    moved = float((hf_logprobs(base, ref_prompt)[0] - ref_lp).abs().max())
    ok = err <= SCORE_TOL and moved > 1e-6
    return ok, f"checkpoint loads in transformers, score err {err:.2e}, moved {moved:.2e}"


def probe(c, opd, seed, work, do_train):
    res = dict(name=c["name"], family=c["family"], expect=c["expect"], note=c["note"])
    model_dir = os.path.join(work, "model")
    try:
        vocab = build_model_dir(c, model_dir, seed, train=do_train and c["name"] in TRAIN_CASES)
    except Exception as e:  # noqa: BLE001
        msg = " ".join(str(e).split())
        res.update(outcome="SKIP", detail=f"transformers cannot build it: {type(e).__name__}: {msg}"[:300])
        return res
    rc, out, err = run_opd(opd, ["info", model_dir, "--json"])
    model64, hf_why = load_hf(model_dir, torch.float64)
    if rc != 0:
        msg = first_error_line(err)
        if rc < 0 or rc >= 128:
            res.update(outcome="ERROR", detail=f"opd info crashed (rc {rc}): {msg}")
            return res
        clear = bool(c["mention"]) and all(m.lower() in msg.lower() for m in c["mention"]) \
            or (not c["mention"] and ("field" in msg or "tensor" in msg))
        res.update(outcome="REFUSED" if clear else "ERROR",
                   detail=("" if clear else "unclear refusal: ") + msg,
                   hf=("loads" if model64 is not None else f"refuses: {hf_why}"))
        return res
    info = json.loads(out)
    if model64 is None:
        res.update(outcome="MISMATCH", detail=f"opd loads it but transformers refuses: {hf_why}")
        return res
    details = []
    ok = True
    n_hf = model64.num_parameters()
    if info["num_parameters"] != n_hf:
        ok = False
        details.append(f"num_parameters opd {info['num_parameters']} vs transformers {n_hf}")
    # config.json's special tokens as transformers resolves them (class defaults included)
    hf_eos = model64.config.eos_token_id
    hf_eos = [] if hf_eos is None else ([hf_eos] if isinstance(hf_eos, int) else list(hf_eos))
    hf_bos = -1 if model64.config.bos_token_id is None else model64.config.bos_token_id
    if info["eos_token_ids"] != hf_eos or info["bos_token_id"] != hf_bos:
        ok = False
        details.append(f"config eos/bos opd {info['eos_token_ids']}/{info['bos_token_id']} vs "
                       f"transformers {hf_eos}/{hf_bos}")
    T = c["prompt_len"]
    ids = probe_ids(seed, vocab, T)
    try:
        ref_lp, _ = hf_logprobs(model64, ids)
    except Exception as e:  # noqa: BLE001 - transformers loads it but cannot run it
        res.update(outcome="MISMATCH", detail=f"opd loads it but transformers' forward fails: "
                                              f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
        return res
    lp, why = opd_logprobs(opd, model_dir, ids, vocab, work)
    if lp is None:
        ok = False
        details.append(f"opd score failed: {why}")
    else:
        err = score_error(lp, ref_lp)
        model32, _ = load_hf(model_dir, torch.float32)
        err32 = score_error(hf_logprobs(model32, ids)[0], ref_lp)
        res["score_err"] = err
        if err > SCORE_TOL:
            ok = False
        details.append(f"score err {err:.1e} (transformers f32: {err32:.1e})")
        gen_ok, gen_msg = compare_generation(opd, model_dir, model64, model32,
                                            generation_prompt(seed, vocab, T), work)
        ok = ok and gen_ok
        details.append(f"generate: {gen_msg}")
    if ok and do_train and c["name"] in TRAIN_CASES:
        tr_ok, tr_msg = train_round_trip(opd, model_dir, vocab, ids[:20], work, seed)
        ok = ok and tr_ok
        details.append(f"train: {tr_msg}")
    res.update(outcome="MATCH" if ok else "MISMATCH", detail="; ".join(details))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--opd", default=os.path.join(REPO, "build", "opd"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", default=[], help="run cases whose name contains one of these")
    ap.add_argument("--train", action="store_true", help="also opd sft one step + load in transformers")
    ap.add_argument("--keep", help="keep the model directories under this folder")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args()
    cases = [c for c in CASES if not a.only or any(s in c["name"] for s in a.only)]
    if a.list:
        for c in cases:
            print(f"{c['name']:36s} expect {c['expect']:7s} {c['note']}")
        return 0
    if not os.access(a.opd, os.X_OK):
        print(f"probe_configs: {a.opd} is not an executable (build it: bash scripts/build.sh --target opd)")
        return 2
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, seed {a.seed}, "
          f"{len(cases)} cases")
    results, failures = [], 0
    t0 = time.time()
    for c in cases:
        work = tempfile.mkdtemp(prefix=f"probe_{c['name']}_")
        try:
            r = probe(c, a.opd, a.seed, work, a.train)
        except Exception as e:  # noqa: BLE001 - a probe bug must not hide the other cases
            r = dict(name=c["name"], expect=c["expect"], outcome="ERROR",
                     detail=f"probe: {type(e).__name__}: {e}")
        finally:
            if a.keep:
                dst = os.path.join(a.keep, c["name"])
                shutil.rmtree(dst, ignore_errors=True)
                shutil.copytree(work, dst)
            shutil.rmtree(work, ignore_errors=True)
        if r["outcome"] == "MISMATCH" and c["known"]:
            r["outcome"] = "KNOWN"
            r["detail"] += f" [known: {c['known']}]"
        passed = (r["outcome"] in ("MATCH", "KNOWN") and c["expect"] == "match") or \
                 (r["outcome"] == "REFUSED" and c["expect"] == "refuse") or r["outcome"] == "SKIP"
        r["passed"] = passed
        failures += not passed
        results.append(r)
        print(f"{'ok  ' if passed else 'FAIL'} {c['name']:36s} {r['outcome']:8s} {r['detail']}", flush=True)
    print(f"{len(results) - failures}/{len(results)} cases as expected ({time.time() - t0:.0f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(seed=a.seed, transformers=transformers.__version__, results=results), f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
