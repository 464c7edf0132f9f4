"""Make a tiny Hugging Face MoE checkpoint folder on this machine (no download), for trying the
fine-tuning recipe of the README end to end without a published checkpoint:

    python examples/make_tiny_hf.py --out tiny-hf [--model-type mixtral|qwen3_moe|deepseek_v3]

The folder holds what a published checkpoint folder holds: `config.json` and sharded
`*.safetensors` written by transformers' own `save_pretrained`, plus `tokenizer.json` and
`tokenizer_config.json` of a byte-level BPE tokenizer trained here with the `tokenizers` library
on this Python's standard-library sources (vocabulary `--vocab`, EOS `<|endoftext|>`), whose
tokenizer_config.json carries a ChatML-style `chat_template` (assistant turns inside
`{% generation %}` blocks, so transformers' `return_assistant_tokens_mask` works too), and
`chat_example.jsonl`: conversations made from the standard library's module docstrings (a user
asks what a module is for, the assistant answers with its docstring's first paragraph), the
input of the README's chat fine-tuning recipe. The weights are transformers' random
initialisation (seed 0): a stand-in with the right layout, not a trained model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ARCH = {
    "mixtral": dict(num_local_experts=8, intermediate_size=256, num_key_value_heads=2),
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=128, intermediate_size=256,
                      num_key_value_heads=2, head_dim=32, norm_topk_prob=True),
    "deepseek_v3": dict(n_routed_experts=8, moe_intermediate_size=128, intermediate_size=256,
                        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32,
                        q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                        n_group=4, topk_group=2, num_key_value_heads=4),
}
EOS = "<|endoftext|>"
# ChatML-style; the turn markers are plain text to this tokenizer (no added tokens) and turns do
# not end with EOS, so --data.doc_mask keeps a whole conversation in one document
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_chat_example(out: Path, n: int = 800) -> int:
    """chat_example.jsonl: one conversation per standard-library module with a docstring."""
    import ast

    from trainer.data import default_corpus_files

    rows = []
    for f in default_corpus_files():
        try:
            doc = ast.get_docstring(ast.parse(f.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if not doc or len(doc) < 40:
            continue
        answer = doc.split("\n\n")[0].strip()
        name = f.stem if f.stem != "__init__" else f.parent.name
        msgs = [{"role": "user", "content": f"What is the Python module {name} for?"},
                {"role": "assistant", "content": answer}]
        if len(rows) % 3 == 0:
            msgs.insert(0, {"role": "system", "content": "You answer questions about Python."})
        rows.append(json.dumps({"messages": msgs}))
        if len(rows) == n:
            break
    (out / "chat_example.jsonl").write_text("".join(r + "\n" for r in rows))
    return len(rows)


def train_tokenizer(vocab: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from trainer.data import default_corpus_files

    files = [str(f) for f in default_corpus_files()[:300]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast",
         "model_max_length": 1024, "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder to create (must not exist)")
    p.add_argument("--model-type", choices=sorted(ARCH), default="mixtral")
    p.add_argument("--vocab", type=int, default=2048, help="tokenizer vocabulary (default 2048)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    a = p.parse_args(argv)
    out = Path(a.out)
    if out.exists():
        print(f"error: --out {str(out)!r} exists; choose a new folder", file=sys.stderr)
        return 2
    if a.vocab < 300:
        print(f"error: --vocab {a.vocab} must be >= 300 (256 bytes + merges + EOS)",
              file=sys.stderr)
        return 2
    import torch
    import transformers

    out.mkdir(parents=True)
    train_tokenizer(a.vocab, out)
    n_chat = write_chat_example(out)
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(
        a.model_type, vocab_size=a.vocab, hidden_size=a.d_model, num_hidden_layers=a.layers,
        num_attention_heads=4, num_experts_per_tok=2, max_position_embeddings=1024,
        eos_token_id=0, **ARCH[a.model_type])
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out, max_shard_size="2MB")
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {a.model_type}, {n / 1e6:.2f}M parameters, {a.layers} layers, "
          f"vocabulary {a.vocab} (EOS {EOS!r} = id 0); {n_chat} conversations in "
          f"{out / 'chat_example.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
