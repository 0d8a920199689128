"""Prompt loading and assistant-only loss masks across chat templates (eagle3.data).

    .venv/bin/pytest tests/test_data.py -q
"""

import json

import pytest

from eagle3.config import DataConfig
from eagle3.data import (ChatTemplateError, iter_sharegpt_records, load_sharegpt_prompts,
                         sharegpt_path, tokenize_conversation)

LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim }}"
    "{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")

THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' %}"
    "{{ '<think>' + (m['reasoning_content'] | default('')) + '</think>' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# The generation prompt opens a think block that rendered assistant turns do not have: the
# prefix rendering is not a prefix of the full one, so no exact mask exists.
NON_PREFIX_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}")

CONVERSATION = [
    {"role": "user", "content": "Hi there, who are you?"},
    {"role": "assistant", "content": "Hello! I am a model."},
    {"role": "user", "content": "Tell me a number."},
    {"role": "assistant", "content": "Forty-two,\nof course."},
]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def llama3_tokenizer(smollm2):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2)
    tok.add_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                    "<|eot_id|>"], special_tokens=True)
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def masked_spans(tok, ids, mask):
    """Decoded runs of consecutive mask-1 tokens."""
    spans, cur = [], []
    for t, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    return spans


def check_ids(tok, ids, messages):
    expected = tok.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert ids == list(expected)


def test_smollm2_template_masks(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CONVERSATION, 4096)
    check_ids(tokenizer, ids, CONVERSATION)
    assert len(mask) == len(ids)
    assert masked_spans(tokenizer, ids, mask) == [
        "Hello! I am a model.<|im_end|>", "Forty-two,\nof course.<|im_end|>"]
    # The default system message and the user turns are unmasked, as is ChatML's "\n" after
    # each <|im_end|> (the template writes it, the model never generates it).
    text_unmasked = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "You are a helpful AI assistant named SmolLM" in text_unmasked
    assert text_unmasked.endswith("<|im_start|>assistant\n\n")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    last_masked = max(i for i, m in enumerate(mask) if m)
    assert ids[last_masked] == im_end and mask[last_masked + 1] == 0


def test_system_prompt_and_truncation(tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}] + CONVERSATION[:2]
    ids, mask = tokenize_conversation(tokenizer, msgs, 4096)
    check_ids(tokenizer, ids, msgs)
    assert "SmolLM" not in tokenizer.decode(ids)
    assert masked_spans(tokenizer, ids, mask) == ["Hello! I am a model.<|im_end|>"]
    short_ids, short_mask = tokenize_conversation(tokenizer, msgs, len(ids) - 4)
    assert short_ids == ids[:len(ids) - 4] and short_mask == mask[:len(ids) - 4]


def test_llama3_style_template_masks(llama3_tokenizer):
    tok = llama3_tokenizer
    ids, mask = tokenize_conversation(tok, CONVERSATION, 4096)
    check_ids(tok, ids, CONVERSATION)
    assert masked_spans(tok, ids, mask) == [
        "Hello! I am a model.<|eot_id|>", "Forty-two,\nof course.<|eot_id|>"]
    assert tok.decode(ids[:1]) == "<|begin_of_text|>" and mask[0] == 0


def test_thinking_template_masks(tokenizer):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = THINKING_TEMPLATE
    msgs = [dict(m) for m in CONVERSATION]
    msgs[1]["reasoning_content"] = "The user asks who I am."
    msgs[3]["reasoning_content"] = "Pick 42."
    ids, mask = tokenize_conversation(tok, msgs, 4096)
    check_ids(tok, ids, msgs)
    assert masked_spans(tok, ids, mask) == [
        "<think>The user asks who I am.</think>Hello! I am a model.<|im_end|>",
        "<think>Pick 42.</think>Forty-two,\nof course.<|im_end|>"]


def test_non_prefix_template_raises(tokenizer):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = NON_PREFIX_TEMPLATE
    with pytest.raises(ChatTemplateError, match="not append-only at assistant turn 1"):
        tokenize_conversation(tok, CONVERSATION, 4096)


def _write_sharegpt(path, records, cut=True):
    text = json.dumps(records, indent=2)
    if cut:  # truncate inside the last record, as in the packaged file
        text = text[:text.rfind('"value"') + 12]
    path.write_text(text)


def test_sharegpt_loader_small_file(tmp_path):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "  first prompt, long enough "},
                                      {"from": "gpt", "value": "answer"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn at all here"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "tiny"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "first prompt, long enough"}]},
        {"id": "e", "conversations": [{"from": "system", "value": "sys"},
                                      {"from": "human", "value": "second prompt, long enough"}]},
        {"id": "f", "conversations": [{"from": "human", "value": "cut off in the middle xx"}]},
    ]
    path = tmp_path / "sg.json"
    _write_sharegpt(path, records)
    assert [r["id"] for r in iter_sharegpt_records(path)] == ["a", "b", "c", "d", "e"]
    jsonl = tmp_path / "oa.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "system", "content": "x"},
                      {"role": "user", "content": "an OpenAI style prompt here"}]},
        {"messages": [{"role": "user", "content": "second prompt, long enough"}]},  # duplicate
    ]) + "\n")
    data = DataConfig(sources=[str(path), str(jsonl)], num_samples=10, min_chars=10,
                      max_chars=100, seed=3)
    rows = load_sharegpt_prompts(data)
    assert sorted((r["id"], r["prompt"]) for r in rows) == [
        ("oa.jsonl:0", "an OpenAI style prompt here"),
        ("sg.json:0:a", "first prompt, long enough"),
        ("sg.json:4:e", "second prompt, long enough")]
    assert load_sharegpt_prompts(data) == rows
    one = load_sharegpt_prompts(DataConfig(sources=[str(path), str(jsonl)], num_samples=1,
                                           min_chars=10, max_chars=100, seed=3))
    assert one == rows[:1]


def test_sharegpt_packaged_file():
    n = sum(1 for _ in iter_sharegpt_records(sharegpt_path()))
    assert n > 17000
    rows = load_sharegpt_prompts(DataConfig(num_samples=20, seed=0))
    assert len(rows) == 20 and len({r["id"] for r in rows}) == 20
    assert all(30 <= len(r["prompt"]) <= 2000 for r in rows)
    # Pinned: the selection for a seed must never drift, or stage 01 outputs silently change.
    assert [r["id"] for r in rows[:3]] == [
        "sharegpt:10455:7CeYpiK_5", "sharegpt:17595:DHoIpRQ_0", "sharegpt:10376:JcvPF3d_0"]
    assert load_sharegpt_prompts(DataConfig(num_samples=20, seed=0)) == rows
    assert load_sharegpt_prompts(DataConfig(num_samples=20, seed=1)) != rows
