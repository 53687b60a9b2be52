"""app/tasks/lm/chat.py: chat messages rendered as transformers renders them, in a sandbox."""

from __future__ import annotations

import pytest

from app.runtime.types import RequestError
from app.tasks.lm.chat import ChatTemplate

pytestmark = pytest.mark.unit

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": 'And "3" + 3 ✓?'},
]
# Templates in the shapes models ship: ChatML (with a check that raises), one with tojson and
# the special tokens, and the tiny test folder's.
CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
JSONISH = (
    "{{ bos_token }}{% for m in messages %}"
    "  {{ m['role'] }}={{ m['content'] | tojson }}\n"
    "{% endfor %}{{ eos_token }}"
)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    from tools.make_tiny_pretrained import gpt2_tokenizer

    tokenizer = gpt2_tokenizer(300)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    return tokenizer


@pytest.mark.parametrize("template", [CHATML, JSONISH], ids=["chatml", "tojson"])
def test_a_model_template_renders_as_transformers_renders_it(hf_tokenizer, template):
    expected = hf_tokenizer.apply_chat_template(
        MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    tokens = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    assert ChatTemplate(template, tokens).render(MESSAGES) == expected


def test_the_tiny_folders_template_is_read_from_the_folder(tmp_path):
    from app.pretrained import Pretrained
    from tools.make_tiny_pretrained import CHAT_TEMPLATE, make_gpt2

    folder = Pretrained(make_gpt2(str(tmp_path / "gpt2")))
    assert folder.chat_template() == CHAT_TEMPLATE
    rendered = ChatTemplate(folder.chat_template(), folder.special_tokens()).render(MESSAGES[:2])
    assert (
        rendered
        == "### SYSTEM\nBe brief.<|endoftext|>\n### USER\nWhat is 2 + 2?<|endoftext|>\n### ASSISTANT\n"
    )


def test_a_template_cannot_reach_python_and_its_own_errors_are_a_400_naming_messages():
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    mutate = "{{ messages.append(1) }}"
    for template in (escape, mutate):
        with pytest.raises(RequestError) as refused:
            ChatTemplate(template).render(MESSAGES)
        assert refused.value.status == 400 and refused.value.message.startswith("messages:")
    with pytest.raises(RequestError, match="unknown role tool"):
        ChatTemplate(CHATML).render([{"role": "tool", "content": "x"}])


def test_a_model_without_a_template_gets_the_plain_one():
    plain = ChatTemplate(None, {"eos_token": "<|endoftext|>"})
    assert plain.name == "plain" and not plain.writes_specials
    assert plain.render(MESSAGES[:2]) == "system: Be brief.\nuser: What is 2 + 2?\nassistant:"
    turns = [*MESSAGES[:2], {"role": "assistant", "content": "4"}, MESSAGES[1]]
    assert plain.render(turns) == (  # an answer ends with the end of text, as trained
        "system: Be brief.\nuser: What is 2 + 2?\nassistant: 4<|endoftext|>\n"
        "user: What is 2 + 2?\nassistant:"
    )


# transformers' template environment: loop controls, the generation block, strftime_now and
# tojson's keyword arguments.
TRANSFORMERS_FEATURES = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{% generation %}{{ m['role'] }}:{{ m['content'] | tojson(ensure_ascii=False, indent=None, "
    "separators=(',', ':'), sort_keys=True) }}{% endgeneration %}\n"
    "{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
    "{% set ns = namespace(n=0) %}{% set ns.n = dict(a=1)['a'] %}{{ ns.n }}"
)


def test_transformers_template_features_render_as_transformers_renders_them(hf_tokenizer):
    expected = hf_tokenizer.apply_chat_template(
        MESSAGES, chat_template=TRANSFORMERS_FEATURES, tokenize=False, add_generation_prompt=True
    )
    assert ChatTemplate(TRANSFORMERS_FEATURES).render(MESSAGES) == expected
    dated = ChatTemplate("{{ strftime_now('%Y') }}").render(MESSAGES)
    assert dated.isdigit() and len(dated) == 4


@pytest.mark.parametrize(
    "template",
    [
        "{% for i in range(100000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
        "{{ 'x' * 10**9 }}",
        "{% for i in range(100000) %}{{ messages | tojson }}{% endfor %}",
    ],
    ids=["10^9 iterations", "a huge value", "a huge output"],
)
def test_a_runaway_template_stops_itself_within_a_second_as_a_400(template):
    import time

    started = time.perf_counter()
    with pytest.raises(RequestError) as refused:
        ChatTemplate(template).render(MESSAGES)
    assert time.perf_counter() - started < 1.0
    assert refused.value.status == 400 and refused.value.message.startswith("messages:")


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        ("{% for m in messages %}{{ m }", "line 1"),
        ("{% break %}", "does not compile"),
        ("{{ raise_exception('no') }}", "renders no plain conversation (no)"),
    ],
)
def test_a_folder_whose_template_fails_is_refused_when_it_is_read(tmp_path, template, reason):
    from app.errors import ConfigError
    from app.pretrained import Pretrained
    from tools.make_tiny_pretrained import make_gpt2

    folder = make_gpt2(str(tmp_path / "gpt2"))
    (tmp_path / "gpt2" / "chat_template.jinja").write_text(template)
    with pytest.raises(ConfigError) as refused:
        Pretrained(folder).chat_template()
    line = str(refused.value)
    assert "\n" not in line and "chat_template.jinja" in line and reason in line
