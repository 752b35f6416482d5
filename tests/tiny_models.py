"""Tiny random targets, tokenizers and drafts for engine tests (built in memory or tmp_path)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = ["<unk>", "<eos>", "<pad>"] + [f"w{i}" for i in range(61)]  # 64 tokens


def tiny_target(family: str = "llama", vocab: int = 64, layers: int = 4, seed: int = 0, hidden: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, eos_token_id=1, pad_token_id=2, bos_token_id=0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, **common))
    else:
        raise ValueError(family)
    # sharpen the output distribution so greedy paths are far from ties and loops appear
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def save_tiny_target(folder: Path, family: str = "llama", vocab: int = 64, **kw) -> Path:
    """A loadable transformers folder: tiny random model + a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_target(family, vocab=vocab, **kw)
    model.save_pretrained(folder)
    words = WORDS[:vocab] if vocab <= len(WORDS) else WORDS + [f"x{i}" for i in range(vocab - len(WORDS))]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(folder)
    return folder


def bigram_oracle_draft(target_adapter, prompts, steps: int = 40, block_size: int = 4, seed: int = 1,
                        strength: float = 30.0, **kw):
    """A random draft whose Markov head encodes the target's own greedy bigrams: high acceptance,
    so multi-token accepts, partial accepts and rejections all happen in a short test."""
    from dsparkctl.engine.speculative import plain_generate
    from dsparkctl.math.sampling import SamplingParams
    from dsparkctl.models.draft_io import random_draft
    from dsparkctl.models.target import TargetAdapter

    plain = TargetAdapter(target_adapter.model, ())
    rep = plain_generate(plain, prompts, steps, SamplingParams(0.0))
    V = target_adapter.vocab_size
    nxt = {}
    for p, o in zip(prompts, rep.outputs):
        seq = list(p) + o.tokens
        for a, b in zip(seq, seq[1:]):
            nxt[a] = b
    draft = random_draft(target_adapter, seed=seed, block_size=block_size, markov_rank=V, **kw)
    with torch.no_grad():
        head = draft.markov_head
        head.markov_w1.weight.copy_(torch.eye(V))
        w2 = torch.zeros(V, V)
        for a, b in nxt.items():
            w2[b, a] = strength
        head.markov_w2.weight.copy_(w2)
    return draft


def write_deepspec_draft(folder: Path, vocab: int = 64, hidden: int = 32, layers: int = 1,
                         taps=(0, 1), rank: int = 8, block_size: int = 4, num_target_layers: int = 4,
                         with_embeddings: bool = False, confidence: bool = True, seed: int = 0,
                         overrides: dict | None = None, tensor_overrides: dict | None = None) -> Path:
    """Write a miniature DeepSpec DSpark draft using the documented tensor names (docs/formats.md §3)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    heads, kv, hd, inter = 4, 2, hidden // 4, 2 * hidden

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    t = {}
    for i in range(layers):
        p = f"layers.{i}."
        t[p + "self_attn.q_proj.weight"] = r(heads * hd, hidden)
        t[p + "self_attn.k_proj.weight"] = r(kv * hd, hidden)
        t[p + "self_attn.v_proj.weight"] = r(kv * hd, hidden)
        t[p + "self_attn.o_proj.weight"] = r(hidden, heads * hd)
        t[p + "self_attn.q_norm.weight"] = torch.ones(hd, dtype=torch.bfloat16)
        t[p + "self_attn.k_norm.weight"] = torch.ones(hd, dtype=torch.bfloat16)
        t[p + "mlp.gate_proj.weight"] = r(inter, hidden)
        t[p + "mlp.up_proj.weight"] = r(inter, hidden)
        t[p + "mlp.down_proj.weight"] = r(hidden, inter)
        t[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    t["norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    t["fc.weight"] = r(hidden, len(taps) * hidden)
    t["hidden_norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    if rank:
        t["markov_head.markov_w1.weight"] = r(vocab, rank)
        t["markov_head.markov_w2.weight"] = r(vocab, rank)
    if confidence:
        t["confidence_head.proj.weight"] = r(1, hidden + rank)
        t["confidence_head.proj.bias"] = torch.zeros(1, dtype=torch.bfloat16)
    if with_embeddings:
        t["embed_tokens.weight"] = r(vocab, hidden)
        t["lm_head.weight"] = r(vocab, hidden)
    t.update(tensor_overrides or {})
    cfg = {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "num_target_layers": num_target_layers, "block_size": block_size,
        "mask_token_id": 2, "target_layer_ids": list(taps), "markov_rank": rank,
        "markov_head_type": "vanilla", "enable_confidence_head": confidence,
        "confidence_head_with_markov": bool(confidence and rank), "num_anchors": 512,
    }
    cfg.update(overrides or {})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder
