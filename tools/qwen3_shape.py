"""The Qwen3 shapes of BENCHMARKS.md as transformers configs, for the PyTorch twins of the
benchmarks (tools/bench_*_torch.py): the same values as opd's src/model/presets.cpp (vocab 151936,
16 query / 8 KV heads of 128, tied embeddings, RMSNorm eps 1e-6, rope_theta 1e6), sdpa attention.
"""


def qwen3_config(hidden, intermediate, layers, use_cache):
    from transformers import Qwen3Config

    kw = dict(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
              num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
              head_dim=128, tie_word_embeddings=True, rms_norm_eps=1e-6,
              max_position_embeddings=40960, initializer_range=0.02, attention_bias=False,
              use_cache=use_cache)
    try:  # transformers 5: rope parameters in one dict
        cfg = Qwen3Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    except TypeError:
        cfg = Qwen3Config(**kw, rope_theta=1e6)
    cfg._attn_implementation = "sdpa"
    return cfg
