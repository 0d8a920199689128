"""The plan's tokenizer preflight: a template that drops a thinking verifier's reasoning fails,
one that renders it passes, and a template with no notion of reasoning is not a false alarm.

    .venv/bin/pytest tests/test_plan.py -q
"""

import pytest

from conftest import make_config
from eagle3.plan import _tokenizer_verdict

RENDERS = ("{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content %}<think>"
           "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}\n{% endfor %}")
DROPS = ("{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content and false %}"
         "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}\n{% endfor %}")


@pytest.mark.parametrize("template, ok", [(None, None), (RENDERS, True), (DROPS, False)])
def test_tokenizer_verdict_tells_dropped_reasoning_from_none(tmp_path, tiny_verifier, template,
                                                             ok):
    verifier = {}
    if template:
        (tmp_path / "t.jinja").write_text(template)
        verifier["chat_template"] = str(tmp_path / "t.jinja")
    cfg = make_config(tmp_path, tiny_verifier, verifier=verifier)
    verdict = _tokenizer_verdict(cfg)
    assert verdict.ok is ok, verdict.detail
    if ok is False:
        assert "verifier.chat_template" in verdict.detail
