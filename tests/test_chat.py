"""Chat: templates rendered as transformers renders them (token ids compared with its
apply_chat_template on SmolLM2's tokenizer), bad conversations refused, and LLM.chat answering
on the real SmolLM2-135M-Instruct."""
import os

import pytest
import torch

from graphexec import LLM, SamplingParams
from graphexec.text.chat import encode_chat, render_chat

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "What colour is the sky?"}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Translate 'good morning' into French.\nJust the phrase."}],
    [{"role": "system", "content": "Tu es un assistant."},
     {"role": "user", "content": "Écris « bonjour » en chinois : 你好? 😀"},
     {"role": "assistant", "content": "你好"},
     {"role": "user", "content": "  spaces  and\ttabs  "}],
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine two threads mostly spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm():
    with LLM("smollm2-135m", max_batch=4, device="cpu", max_model_len=512) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    from graphexec.model.loader import shipped_model_path

    path = shipped_model_path("smollm2-135m")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                      gguf_file=os.path.basename(path))


def _hf_ids(hf, conv, add_generation_prompt=True):
    out = hf.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                 tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_ids_equal_transformers(llm, hf_tokenizer, index):
    tok, conv = llm.engine.tokenizer, CONVERSATIONS[index]
    assert render_chat(tok, conv) == hf_tokenizer.apply_chat_template(
        conv, add_generation_prompt=True, tokenize=False)
    assert encode_chat(tok, conv) == _hf_ids(hf_tokenizer, conv)


def test_without_generation_prompt(llm, hf_tokenizer):
    conv = CONVERSATIONS[2]
    ids = encode_chat(llm.engine.tokenizer, conv, add_generation_prompt=False)
    assert ids == _hf_ids(hf_tokenizer, conv, add_generation_prompt=False)
    assert ids != encode_chat(llm.engine.tokenizer, conv)


def test_llm_chat_answers(llm):
    greedy = SamplingParams(max_tokens=24, temperature=0)
    outs = llm.chat(CONVERSATIONS[0], greedy)
    assert len(outs) == 1
    out = outs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # <|im_end|> ends the answer
    assert out.text == llm.engine.tokenizer.decode(out.token_ids)
    # a list of conversations: one output each, in order; the first answer is unchanged
    both = llm.chat([CONVERSATIONS[0], CONVERSATIONS[1]], SamplingParams(max_tokens=6,
                                                                          temperature=0))
    assert [o.token_ids for o in both][0] == out.token_ids[:6]
    assert len(both) == 2 and both[1].text


def test_stop_string_on_the_real_model(llm):
    out, = llm.chat(CONVERSATIONS[0], SamplingParams(max_tokens=24, temperature=0,
                                                      stop=[" Paris", "\n\n"]))
    assert out.finish_reason == "stop"
    assert out.text == "The capital of France is"
    assert "Paris" in llm.engine.tokenizer.decode(out.token_ids)  # its tokens stay


@pytest.mark.parametrize("messages,match", [
    ([{"content": "hi"}], r"messages\[0\]\.role"),
    ([{"role": "user"}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": 3}], r"content.*3"),
    ([[{"role": "user", "content": "a"}], [{"role": "user"}]], r"messages\[1\]\[0\]\.content"),
    ([], "messages"),
    ("hello", "messages"),
    ([["not a dict"]], r"messages\[0\]"),
])
def test_bad_conversations_name_the_field(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages)


class _Tok:
    chat_template = None
    bos_token, eos_token = "<s>", "</s>"


def test_a_model_without_a_template():
    with pytest.raises(ValueError, match="chat_template"):
        render_chat(_Tok(), CONVERSATIONS[0])
    with LLM("tiny", max_batch=2, num_kv_blocks=16, device="cpu") as tiny:
        with pytest.raises(ValueError, match="tokenizer"):
            tiny.chat(CONVERSATIONS[0])


def test_template_helpers():
    tpl = ("{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
           "{{ bos_token }}{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}"
           "{% for m in messages %}{% if true %}{% break %}{% endif %}{% endfor %}")
    out = render_chat(_Tok(), [{"role": "user", "content": "café <b>"}], chat_template=tpl)
    assert out == '<s>{"role": "user", "content": "café <b>"}|4'
    with pytest.raises(ValueError, match="one message only"):
        render_chat(_Tok(), CONVERSATIONS[1], chat_template=tpl)


def test_the_template_runs_sandboxed():
    tpl = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(Exception, match="unsafe|access"):
        render_chat(_Tok(), CONVERSATIONS[0], chat_template=tpl)
