"""Tiny random checkpoints, tokenizers and PEFT adapters, built locally for tests, benchmarks and the demo.

Nothing here downloads anything: models are random-initialised ``transformers`` configs, the tokenizer
is a byte-level BPE trained on a few sentences, adapters are made (and optionally trained) with ``peft``.
Needs the ``dev`` extra (torch, transformers, peft); the serving path never imports this module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS = [
    "What is the capital of France? The capital of France is Paris.",
    "Answer the question: who wrote the book? The answer is simple.",
    "Adapters make one base model speak many dialects, one request at a time.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "loraserve serves many LoRA adapters on one base model with batched kernels.",
    "Numbers: one two three four five six seven eight nine ten. Colors: red green blue.",
    "Ünïcödé text: café, naïve, 東京, emoji 🙂 and more bytes to keep the tokenizer honest.",
]

TINY = {
    "llama": dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "mistral": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
    ),
    # q/k norm, head_dim 24 (q_size 96 != hidden), layer 0 full and layers 1-2 through a 5-token window
    "qwen3": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=1,
    ),
    # sliding (4 tokens) / full / sliding by transformers' default rule, soft caps small enough to bite
    "gemma2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=4,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=2.5,
    ),
    # q/k norm, head_dim 32 (q_size 128), MQA, sliding layers with their own RoPE base, linear-scaled
    # RoPE on the full layer
    "gemma3_text": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=48,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
    ),
    # mixture of experts: 8 experts top-3 renormalised, q/k norm
    "qwen3_moe": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    # 4 experts top-2 (always renormalised)
    "mixtral": dict(
        hidden_size=64,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
    # 6 experts top-2, not renormalised, and a shared expert behind a sigmoid gate; qkv bias
    "qwen2_moe": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}
GEMMA_NORMS = ("gemma2", "gemma3_text")  # RMSNorm weight w scales by (1 + w)
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")


# A small chat template in the style of instruction-tuned checkpoints (saved in tokenizer_config.json).
# Tools render as Qwen's and Hermes' templates do: the functions' JSON in a system turn, an assistant's calls
# as <tool_call>{"name": ..., "arguments": ...}</tool_call> (compact JSON: the tiny test contexts are short); a
# conversation without them renders as before.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}tools:"
    "{% for t in tools %} {{ t['function'] | tojson(separators=(',', ':')) }}{% endfor %}{{ '\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] if m['content'] is not none else '' }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{\"name\": {{ c['function']['name'] | tojson }}, "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def train_bpe(corpus: list[str], vocab_size: int) -> Any:
    """A byte-level BPE of ``vocab_size`` tokens (``<unk>``, ``<s>``, ``</s>`` first) trained on ``corpus``, as
    a ``transformers`` fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def build_tokenizer(
    path: str | Path, vocab_size: int = 384, chat_template: str | None = CHAT_TEMPLATE
) -> Any:
    """Train a byte-level BPE on ``CORPUS`` and save it (tokenizer.json + config, with ``chat_template``
    unless None: a base model without one) under ``path``."""
    fast = train_bpe(CORPUS * 4, vocab_size)
    fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return fast


def _reference_attention(config: Any) -> dict[str, str]:
    """How ``transformers`` must compute a model's attention to be a reference: a family with attention
    soft-capping (Gemma 2) in eager mode. transformers before 5.2x loads it with sdpa by default, which drops
    the soft-cap without a word (0.17 off in logits on the tiny model; 5.24 refuses sdpa for it instead)."""
    return {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping", None) else {}


def build_model(model_type: str = "llama", seed: int = 0, vocab_size: int = 384, **overrides: Any) -> Any:
    """A random-initialised ``transformers`` causal LM of the given family (tiny unless overridden)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs: dict[str, Any] = dict(TINY[model_type])
    kwargs.update(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, max_position_embeddings=512)
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **_reference_attention(config))
    with torch.no_grad():  # HF's 0.02 init gives near-uniform logits; widen it so argmax is decisive
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if model_type in GEMMA_NORMS else 1.0) + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # a MoE router: decisive choices (no near-ties in top-k)
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.08 if p.dim() > 1 else 0.02)
    return model.eval()


def save_model(
    path: str | Path,
    model_type: str = "llama",
    seed: int = 0,
    chat_template: str | None = CHAT_TEMPLATE,
    **overrides: Any,
) -> Path:
    """Build a tiny random model plus tokenizer and save both as a Hugging Face checkpoint folder."""
    path = Path(path)
    build_tokenizer(path, chat_template=chat_template)
    model = build_model(model_type, seed=seed, **overrides)
    model.save_pretrained(str(path), safe_serialization=True)
    if attention := _reference_attention(model.config):  # save_pretrained leaves the choice out
        config_file = path / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **attention}, indent=2))
    return path


def make_adapter(
    model: Any,
    out: str | Path | None = None,
    *,
    r: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    use_rslora: bool = False,
    seed: int = 0,
    scale: float = 0.05,
    **config: Any,
) -> Any:
    """Wrap ``model`` with a random LoRA adapter (both A and B non-zero) and optionally save it to ``out``.

    Returns the ``PeftModel``. ``scale`` is the std of the random A/B entries (and of ``lora_bias``'s
    biases). With ``use_dora=True`` each DoRA magnitude is the norm PEFT starts from (``||W + s·B·A||``
    per output row) times ``1 + 0.3·N(0, 1)``, so every channel's scale differs from 1.
    """
    import torch
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=use_rslora,
        lora_dropout=0.0,
        bias="none",
        init_lora_weights=False,
        task_type="CAUSAL_LM",
        **config,
    )
    peft_model = get_peft_model(model, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, scale)
        for module in peft_model.modules():
            dora = getattr(module, "lora_magnitude_vector", None)
            if dora is None or "default" not in dora:
                continue
            weight = module.get_base_layer().weight
            delta = module.lora_B["default"].weight @ module.lora_A["default"].weight
            norm = torch.linalg.norm(weight + module.scaling["default"] * delta, dim=1)
            dora["default"].weight.copy_(norm * (1.0 + 0.3 * torch.randn(norm.shape)))
    if out is not None:
        peft_model.save_pretrained(str(out), safe_serialization=True)
    return peft_model


def train_answer_adapter(
    base_dir: str | Path,
    out: str | Path,
    prompt_ids: list[int],
    answer_ids: list[int],
    *,
    r: int = 8,
    alpha: float = 16.0,
    steps: int = 60,
    lr: float = 2e-2,
    seed: int = 0,
) -> Path:
    """Train a LoRA adapter with ``peft`` so that greedy decoding of ``prompt_ids`` yields ``answer_ids``.

    Full teacher forcing on one sequence, Adam, a few seconds on a CPU for the tiny models; the loss
    drives every answer position, so the adapter answers this question with exactly these tokens.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir))
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, cfg)
    seq = torch.tensor([prompt_ids + answer_ids])
    labels = seq.clone()
    labels[0, : len(prompt_ids)] = -100
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=seq, labels=labels).loss
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    model.eval()
    with torch.no_grad():
        got = model(seq).logits[0, len(prompt_ids) - 1 : -1].argmax(-1).tolist()
    if got != answer_ids:
        raise RuntimeError(f"adapter training did not converge: wanted {answer_ids}, got {got}")
    model.save_pretrained(str(out), safe_serialization=True)
    return Path(out)
