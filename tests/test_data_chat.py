"""Chat fine-tuning data: `prepare --chat` ids and loss masks, and the trainer's masked loss.

Reference for the masks: transformers' own `apply_chat_template(..., return_assistant_tokens_mask
=True)` on templates whose assistant turns sit in `{% generation %}` blocks (prepare finds the
turns by rendering prefixes instead, so the two methods are independent). Reference for the
loss: log-softmax picked at the kept targets, averaged by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from model import cross_entropy
from trainer.data import DataError, load_corpus, load_data, mask_path
from trainer.data.prepare import prepare

transformers = pytest.importorskip("transformers")

CHATML = (  # the template of examples/make_tiny_hf.py
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
INST = (  # Llama-2-like: BOS first, [INST] around user turns, special end-of-turn token
    "<s>{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'system' %}<<SYS>>{{ m['content'] }}<</SYS>>"
    "{% elif m['role'] == 'assistant' %}{% generation %} {{ m['content'] }}</turn>"
    "{% endgeneration %}{% else %}<tool>{{ m['content'] }}</tool>{% endif %}"
    "{% endfor %}")
CONVS = [
    [{"role": "user", "content": "what is two plus two"},
     {"role": "assistant", "content": "two plus two is four"}],
    [{"role": "system", "content": "you are terse"},
     {"role": "user", "content": "name a colour"},
     {"role": "assistant", "content": "blue"},
     {"role": "user", "content": "another one"},
     {"role": "assistant", "content": "green, and then red"}],
    [{"role": "user", "content": "say nothing"}, {"role": "assistant", "content": ""},
     {"role": "tool", "content": "{\"ok\": true}"}],
]


def _tokenizer(d, template: str):
    words = [m["content"] for c in CONVS for m in c] + ["user assistant system tool im_start"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(words, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "</s>", "<s>", "</turn>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template}))
    return d


@pytest.fixture(params=["chatml", "inst"])
def chat_dir(request, tmp_path):
    return _tokenizer(tmp_path / request.param, CHATML if request.param == "chatml" else INST)


def _jsonl(path, convs, field="messages"):
    path.write_text("".join(json.dumps({field: c}) + "\n" for c in convs))
    return str(path)


@pytest.mark.parametrize("workers", [1, 2])
def test_masks_equal_transformers_assistant_masks(tmp_path, chat_dir, workers):
    src = _jsonl(tmp_path / "c.jsonl", CONVS)
    meta = prepare(chat_dir, [src], tmp_path / "c.bin", workers=workers, progress=False,
                   chat=True, batch_bytes=1)  # one conversation per task: crosses workers
    hf = transformers.AutoTokenizer.from_pretrained(str(chat_dir))
    eos = hf.convert_tokens_to_ids("</s>")
    want_ids: list[int] = []
    want_mask: list[int] = []
    for c in CONVS:
        r = hf.apply_chat_template(c, tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)
        want_ids += [*r["input_ids"], eos]
        want_mask += [*r["assistant_masks"], 0]
    ids = np.fromfile(tmp_path / "c.bin", dtype=np.uint16)
    mask = np.fromfile(mask_path(tmp_path / "c.bin"), dtype=np.uint8)
    assert ids.tolist() == want_ids
    assert mask.tolist() == want_mask
    assert 0 < sum(want_mask) < len(want_mask)  # both kinds of token are present
    assert meta["n_loss_tokens"] == sum(want_mask) and meta["loss_mask"]["file"] == "c.mask"
    c = load_corpus(str(tmp_path / "c.bin"), 0.1)
    assert np.array_equal(np.concatenate([c.mask_train, c.mask_val]), mask)


def test_batches_mask_targets_and_the_loss_counts_only_them(tmp_path):
    rng = np.random.default_rng(0)
    n = 4000
    np.arange(n, dtype=np.uint16).tofile(tmp_path / "t.bin")
    mask = (rng.random(n) < 0.3).astype(np.uint8)
    mask.tofile(tmp_path / "t.mask")
    (tmp_path / "t.json").write_text(json.dumps({
        "format": "piper-moe-tokens", "version": 1, "dtype": "uint16", "vocab_size": n,
        "eos_id": 0, "n_tokens": n, "loss_mask": {"file": "t.mask", "dtype": "uint8"}}))
    data = load_data(str(tmp_path / "t.bin"), 0.05, loss_mask=True)
    x, y = data.batch(2, 8, 16, 0, 1, seed=0)
    for row_x, row_y in zip(x.numpy(), y.numpy(), strict=True):
        nxt = row_x + 1  # token value = its offset: the target of x is x + 1
        assert np.array_equal(row_y, np.where(mask[nxt] == 1, nxt, -100))
    # without --data.loss_mask the same file trains on every token
    _, y_all = load_data(str(tmp_path / "t.bin"), 0.05).batch(2, 8, 16, 0, 1, seed=0)
    assert (y_all >= 0).all()
    logits = torch.randn(8, 16, 50)
    t = torch.where(y >= 0, y % 50, y)
    keep = t >= 0
    logp = torch.log_softmax(logits, -1).gather(-1, t.clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(cross_entropy(logits, t), -logp[keep].mean())
    none = torch.full_like(t, -100)  # a micro-batch without an assistant token: 0, not NaN
    z = logits.clone().requires_grad_()
    loss = cross_entropy(z, none)
    loss.backward()
    assert loss.item() == 0 and torch.isfinite(z.grad).all()


def test_bad_chat_inputs(tmp_path):
    d = _tokenizer(tmp_path / "tok", CHATML)
    cases = {
        "unknown role": ([[{"role": "robot", "content": "x"},
                           {"role": "assistant", "content": "y"}]],
                         "unknown role 'robot'; valid: system, user, assistant, tool"),
        "no assistant": ([[{"role": "user", "content": "x"}]], "has no assistant turn"),
        "not a list": (["hello"], "messages is str, not a non-empty list"),
        "no content": ([[{"role": "assistant"}]], "message 0 is"),
    }
    for name, (convs, needle) in cases.items():
        src = _jsonl(tmp_path / f"{name}.jsonl", convs)
        with pytest.raises(DataError, match=needle):
            prepare(d, [src], tmp_path / "o.bin", progress=False, chat=True)
        assert not (tmp_path / "o.bin").exists(), name
    # a bad conversation after the first one stops the run and leaves nothing behind
    src = _jsonl(tmp_path / "late.jsonl", [CONVS[0], [{"role": "user", "content": "x"}]])
    with pytest.raises(DataError, match=r"late.jsonl:2: the conversation has no assistant"):
        prepare(d, [src], tmp_path / "o.bin", progress=False, chat=True, workers=1)
    assert not any(tmp_path.glob("o.*"))
    txt = tmp_path / "plain.txt"
    txt.write_text("just text")
    with pytest.raises(DataError, match="plain text file"):
        prepare(d, [str(txt)], tmp_path / "o.bin", progress=False, chat=True)
    nochat = _tokenizer(tmp_path / "nochat", CHATML)
    cfg = json.loads((nochat / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (nochat / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(DataError, match="has no chat_template"):
        prepare(nochat, [_jsonl(tmp_path / "ok.jsonl", CONVS)], tmp_path / "o.bin",
                progress=False, chat=True)
    # a mask whose length differs from the tokens
    prepare(d, [_jsonl(tmp_path / "ok.jsonl", CONVS)], tmp_path / "good.bin", progress=False,
            chat=True)
    with open(tmp_path / "good.mask", "ab") as f:
        f.write(b"\x01")
    with pytest.raises(DataError, match=r"good.mask' has \d+ entries but .* holds \d+ tokens"):
        load_corpus(str(tmp_path / "good.bin"), 0.1)


@pytest.mark.integration
def test_chat_recipe_trains_with_loss_and_doc_masks(tmp_path):
    """The README's chat variant on a tokenizer of the same kind: prepare --chat, then train
    with --data.loss_mask=true --data.doc_mask=true (one process, 2 steps)."""
    from conftest import run_train, step_losses

    d = _tokenizer(tmp_path / "tok", CHATML)
    src = _jsonl(tmp_path / "c.jsonl", CONVS * 60)
    prepare(d, [src], tmp_path / "c.bin", progress=False, chat=True)
    out = tmp_path / "run"
    r = run_train(["--data", str(tmp_path / "c.bin"), "--data.loss_mask=true",
                   "--data.doc_mask=true", "--data.val_fraction=0.05", "--model.vocab_size=400",
                   "--model.d_model=32", "--train.seq_len=64", "--train.global_batch=2",
                   "--train.steps=2", "--train.eval_every=0", "--train.eval_batches=1",
                   "--train.plot=false", f"--train.out_dir={out}"])
    assert r.returncode == 0, r.stderr[-3000:]
    losses = step_losses(out)
    assert len(losses) == 2 and all(np.isfinite(v) for v in losses.values())
