"""llama.cpp's built-in chat formats (`llm_chat_apply_template` in its src/llama-chat.cpp, b11549): what
`--chat-template NAME` renders, ported turn for turn. Each takes the messages (role, content) and whether
to end with the assistant's turn header."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from .settings import ChatTemplateName as N

Turns = Sequence[Mapping[str, str]]
Format = Callable[[Turns, bool], str]


def _trim(text: str) -> str:
    return text.strip(" \t\n\v\f\r")  # C's isspace


def _chatml(chat: Turns, add_ass: bool) -> str:
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in chat)
    return out + ("<|im_start|>assistant\n" if add_ass else "")


def _mistral_v7(space: str) -> Format:
    def render(chat: Turns, add_ass: bool) -> str:
        out = []
        for m in chat:
            if m["role"] == "system":
                out.append(f"[SYSTEM_PROMPT]{space}{m['content']}[/SYSTEM_PROMPT]")
            elif m["role"] == "user":
                out.append(f"[INST]{space}{m['content']}[/INST]")
            else:
                out.append(f"{space}{m['content']}</s>")
        return "".join(out)

    return render


def _mistral(leading: str, trailing: str, trim_assistant: bool) -> Format:
    def render(chat: Turns, add_ass: bool) -> str:
        out, inside = [], False
        for m in chat:
            if not inside:
                out.append(f"{leading}[INST]{trailing}")
                inside = True
            if m["role"] == "system":
                out.append(m["content"] + "\n\n")
            elif m["role"] == "user":
                out.append(f"{m['content']}{leading}[/INST]")
            else:
                content = _trim(m["content"]) if trim_assistant else m["content"]
                out.append(f"{trailing}{content}</s>")
                inside = False
        return "".join(out)

    return render


def _llama2(system: bool, bos_inside: bool, strip: bool) -> Format:
    def render(chat: Turns, add_ass: bool) -> str:
        out, inside = ["[INST] "], True  # no BOS at the start
        for m in chat:
            content = _trim(m["content"]) if strip else m["content"]
            if not inside:
                inside = True
                out.append("<s>[INST] " if bos_inside else "[INST] ")
            if m["role"] == "system":
                out.append(f"<<SYS>>\n{content}\n<</SYS>>\n\n" if system else content + "\n")
            elif m["role"] == "user":
                out.append(content + " [/INST]")
            else:
                out.append(content + "</s>")
                inside = False
        return "".join(out)

    return render


def _each(turn: Callable[[str, str], str], generation: str, prefix: str = "") -> Format:
    """A format that writes every message the same way (`turn(role, content)`)."""

    def render(chat: Turns, add_ass: bool) -> str:
        body = "".join(turn(m["role"], m["content"]) for m in chat)
        return prefix + body + (generation if add_ass else "")

    return render


def _by_role(turns: Mapping[str, Callable[[str], str]], generation: str, prefix: str = "") -> Format:
    """A format that writes each role its own way; a role not listed is left out."""

    def render(chat: Turns, add_ass: bool) -> str:
        body = "".join(turns[m["role"]](m["content"]) for m in chat if m["role"] in turns)
        return prefix + body + (generation if add_ass else "")

    return render


def _monarch(chat: Turns, add_ass: bool) -> str:
    out = "".join(
        ("" if i == 0 else "<s>") + f"{m['role']}\n{m['content']}</s>\n" for i, m in enumerate(chat)
    )
    return out + ("<s>assistant\n" if add_ass else "")


def _gemma(chat: Turns, add_ass: bool) -> str:
    out, system = [], ""
    for m in chat:
        if m["role"] == "system":
            system += _trim(m["content"])  # no system turn: folded into the next user turn
            continue
        role = "model" if m["role"] == "assistant" else m["role"]
        out.append(f"<start_of_turn>{role}\n")
        if system and role != "model":
            out.append(system + "\n\n")
            system = ""
        out.append(_trim(m["content"]) + "<end_of_turn>\n")
    return "".join(out) + ("<start_of_turn>model\n" if add_ass else "")


def _orion(chat: Turns, add_ass: bool) -> str:
    out, system = [], ""
    for m in chat:
        if m["role"] == "system":
            system += m["content"]
        elif m["role"] == "user":
            out.append("Human: " + (system + "\n\n" if system else "") + m["content"] + "\n\nAssistant: </s>")
            system = ""
        else:
            out.append(m["content"] + "</s>")
    return "".join(out)


def _openchat(chat: Turns, add_ass: bool) -> str:
    out = []
    for m in chat:
        if m["role"] == "system":
            out.append(m["content"] + "<|end_of_turn|>")
        else:
            role = m["role"][:1].upper() + m["role"][1:]
            out.append(f"GPT4 Correct {role}: {m['content']}<|end_of_turn|>")
    return "".join(out) + ("GPT4 Correct Assistant:" if add_ass else "")


def _minicpm(chat: Turns, add_ass: bool) -> str:
    return "".join(
        f"<用户>{_trim(m['content'])}<AI>" if m["role"] == "user" else _trim(m["content"]) for m in chat
    )


def _rwkv_world(chat: Turns, add_ass: bool) -> str:
    out = []
    for i, m in enumerate(chat):
        if m["role"] == "system":
            out.append(f"System: {_trim(m['content'])}\n\n")
        elif m["role"] == "user":
            out.append(f"User: {_trim(m['content'])}\n\n" + ("Assistant:" if i == len(chat) - 1 else ""))
        elif m["role"] == "assistant":
            out.append(f"Assistant: {_trim(m['content'])}\n\n")
    return "".join(out)


def _granite3(chat: Turns, add_ass: bool) -> str:
    out = "".join(
        f"<|start_of_role|>{m['role']}<|end_of_role|>"
        + ("<|tool_call|>" if m["role"] == "assistant_tool_call" else "")
        + f"{m['content']}<|end_of_text|>\n"
        for m in chat
    )
    return out + ("<|start_of_role|>assistant<|end_of_role|>" if add_ass else "")


def _granite4(chat: Turns, add_ass: bool) -> str:
    out = "".join(
        (
            "<|start_of_role|>assistant<|end_of_role|><|tool_call|>"
            if m["role"] == "assistant_tool_call"
            else f"<|start_of_role|>{m['role']}<|end_of_role|>"
        )
        + f"{m['content']}<|end_of_text|>\n"
        for m in chat
    )
    return out + ("<|start_of_role|>assistant<|end_of_role|>" if add_ass else "")


def _gigachat(chat: Turns, add_ass: bool) -> str:
    has_system = bool(chat) and chat[0]["role"] == "system"
    out = ["<s>" + (chat[0]["content"] + "<|message_sep|>" if has_system else "")]
    for m in chat[1 if has_system else 0 :]:
        if m["role"] == "user":
            out.append(
                f"user<|role_sep|>{m['content']}<|message_sep|>available functions<|role_sep|>[]<|message_sep|>"
            )
        elif m["role"] == "assistant":
            out.append(f"assistant<|role_sep|>{m['content']}<|message_sep|>")
    return "".join(out) + ("assistant<|role_sep|>" if add_ass else "")


def _bailing_role(role: str) -> str:
    return "HUMAN" if role == "user" else role.upper()


def _bailing(think: bool) -> Format:
    def render(chat: Turns, add_ass: bool) -> str:
        out = "".join(f"<role>{_bailing_role(m['role'])}</role>{m['content']}" for m in chat)
        return out + (("<role>ASSISTANT</role>" + ("<think>" if think else "")) if add_ass else "")

    return render


def _bailing2(chat: Turns, add_ass: bool) -> str:
    has_system = bool(chat) and chat[0]["role"] == "system"
    out = "" if has_system else "<role>SYSTEM</role>detailed thinking off<|role_end|>"
    out += "".join(f"<role>{_bailing_role(m['role'])}</role>{m['content']}<|role_end|>" for m in chat)
    return out + ("<role>ASSISTANT</role>" if add_ass else "")


def _hunyuan_moe(chat: Turns, add_ass: bool) -> str:
    out = []
    for m in chat:
        if m["role"] == "system":
            out.append(f"<|startoftext|>{m['content']}<|extra_4|>")
        elif m["role"] == "assistant":
            out.append(m["content"] + "<|eos|>")
        else:
            out.append(f"<|startoftext|>{m['content']}<|extra_0|>")
    return "".join(out)


def _hunyuan_dense(chat: Turns, add_ass: bool) -> str:
    out = []
    for i, m in enumerate(chat):
        if i == 0 and m["role"] == "system":
            out.append(m["content"] + "<｜hy_place▁holder▁no▁3｜>")
        if m["role"] == "assistant":
            out.append(f"<｜hy_Assistant｜>{m['content']}<｜hy_place▁holder▁no▁2｜>")
        elif m["role"] == "user":
            out.append(f"<｜hy_User｜>{m['content']}<｜hy_Assistant｜>")
    return "".join(out)


def _hunyuan_vl(chat: Turns, add_ass: bool) -> str:
    out = ["<｜hy_begin▁of▁sentence｜>"]
    for i, m in enumerate(chat):
        if i == 0 and m["role"] == "system":
            out.append(m["content"] + "<｜hy_place▁holder▁no▁3｜>")
        elif m["role"] == "user":
            out.append(m["content"] + "<｜hy_User｜>")
        elif m["role"] == "assistant":
            out.append(m["content"] + "<｜hy_Assistant｜>")
    return "".join(out)


_KIMI_HEADERS = {
    "system": "<|im_system|>system<|im_middle|>",
    "user": "<|im_user|>user<|im_middle|>",
    "assistant": "<|im_assistant|>assistant<|im_middle|>",
    "tool": "<|im_system|>tool<|im_middle|>",
}


def _kimi_k2(chat: Turns, add_ass: bool) -> str:
    out = "".join(_KIMI_HEADERS.get(m["role"], "") + m["content"] + "<|im_end|>" for m in chat)
    return out + ("<|im_assistant|>assistant<|im_middle|>" if add_ass else "")


_PANGU_ROLES = {"system": "系统", "user": "用户", "assistant": "助手", "tool": "工具", "function": "方法"}


def _pangu_embedded(chat: Turns, add_ass: bool) -> str:
    out = []
    for i, m in enumerate(chat):
        if i == 0 and m["role"] != "system":
            out.append("[unused9]系统：[unused10]")
        if m["role"] in _PANGU_ROLES:
            out.append(f"[unused9]{_PANGU_ROLES[m['role']]}：{m['content']}[unused10]")
    return "".join(out) + ("[unused9]助手：" if add_ass else "")


def _wrapped(head: str, tail: str) -> Callable[[str], str]:
    """One role's turn: `head`, the trimmed content, `tail`."""
    return lambda text: head + _trim(text) + tail


def _header(open_: str, close: str, end: str, generation: str) -> Format:
    """Llama 3-style turns: a role header, the trimmed content, an end-of-turn token."""
    return _each(lambda role, text: f"{open_}{role}{close}{_trim(text)}{end}", generation)


# --chat-template NAME -> its format (llama.cpp's LLM_CHAT_TEMPLATES, every name)
FORMATS: Mapping[N, Format] = {
    N.CHATML: _chatml,
    N.LLAMA2: _llama2(system=False, bos_inside=False, strip=False),
    N.LLAMA2_SYS: _llama2(system=True, bos_inside=False, strip=False),
    N.LLAMA2_SYS_BOS: _llama2(system=True, bos_inside=True, strip=False),
    N.LLAMA2_SYS_STRIP: _llama2(system=True, bos_inside=False, strip=True),
    N.MISTRAL_V1: _mistral(" ", " ", trim_assistant=False),
    N.MISTRAL_V3: _mistral("", " ", trim_assistant=True),
    N.MISTRAL_V3_TEKKEN: _mistral("", "", trim_assistant=False),
    N.MISTRAL_V7: _mistral_v7(" "),
    N.MISTRAL_V7_TEKKEN: _mistral_v7(""),
    N.PHI3: _each(lambda role, text: f"<|{role}|>\n{text}<|end|>\n", "<|assistant|>\n"),
    N.PHI4: _each(
        lambda role, text: f"<|im_start|>{role}<|im_sep|>{text}<|im_end|>", "<|im_start|>assistant<|im_sep|>"
    ),
    N.FALCON3: _each(lambda role, text: f"<|{role}|>\n{text}\n", "<|assistant|>\n"),
    N.ZEPHYR: _each(lambda role, text: f"<|{role}|>\n{text}<|endoftext|>\n", "<|assistant|>\n"),
    N.MONARCH: _monarch,
    N.GEMMA: _gemma,
    N.ORION: _orion,
    N.OPENCHAT: _openchat,
    N.VICUNA: _by_role(
        {
            "system": lambda text: text + "\n\n",
            "user": lambda text: f"USER: {text}\n",
            "assistant": lambda text: f"ASSISTANT: {text}</s>\n",
        },
        "ASSISTANT:",
    ),
    N.VICUNA_ORCA: _by_role(
        {
            "system": lambda text: f"SYSTEM: {text}\n",
            "user": lambda text: f"USER: {text}\n",
            "assistant": lambda text: f"ASSISTANT: {text}</s>\n",
        },
        "ASSISTANT:",
    ),
    N.DEEPSEEK: _by_role(
        {
            "system": lambda text: text,
            "user": lambda text: f"### Instruction:\n{text}\n",
            "assistant": lambda text: f"### Response:\n{text}\n<|EOT|>\n",
        },
        "### Response:\n",
    ),
    N.DEEPSEEK2: _by_role(
        {
            "system": lambda text: text + "\n\n",
            "user": lambda text: f"User: {text}\n\n",
            "assistant": lambda text: f"Assistant: {text}<｜end▁of▁sentence｜>",
        },
        "Assistant:",
    ),
    N.DEEPSEEK3: _by_role(
        {
            "system": lambda text: text + "\n\n",
            "user": lambda text: "<｜User｜>" + text,
            "assistant": lambda text: f"<｜Assistant｜>{text}<｜end▁of▁sentence｜>",
        },
        "<｜Assistant｜>",
    ),
    N.DEEPSEEK_OCR: lambda chat, add_ass: "".join(m["content"] for m in chat),
    N.COMMAND_R: _by_role(
        {
            role: _wrapped(f"<|START_OF_TURN_TOKEN|>{token}", "<|END_OF_TURN_TOKEN|>")
            for role, token in (
                ("system", "<|SYSTEM_TOKEN|>"),
                ("user", "<|USER_TOKEN|>"),
                ("assistant", "<|CHATBOT_TOKEN|>"),
            )
        },
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    ),
    N.LLAMA3: _header(
        "<|start_header_id|>",
        "<|end_header_id|>\n\n",
        "<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    N.CHATGLM3: _each(lambda role, text: f"<|{role}|>\n {text}", "<|assistant|>", prefix="[gMASK]sop"),
    N.CHATGLM4: _each(lambda role, text: f"<|{role}|>\n{text}", "<|assistant|>\n", prefix="[gMASK]<sop>"),
    N.GLMEDGE: _each(lambda role, text: f"<|{role}|>\n{text}", "<|assistant|>"),
    N.MINICPM: _minicpm,
    N.EXAONE3: _by_role(
        {
            "system": lambda text: f"[|system|]{_trim(text)}[|endofturn|]\n",
            "user": lambda text: f"[|user|]{_trim(text)}\n",
            "assistant": lambda text: f"[|assistant|]{_trim(text)}[|endofturn|]\n",
        },
        "[|assistant|]",
    ),
    N.EXAONE4: _by_role(
        {
            "system": lambda text: f"[|system|]{_trim(text)}[|endofturn|]\n",
            "user": lambda text: f"[|user|]{_trim(text)}\n",
            "assistant": lambda text: f"[|assistant|]{_trim(text)}[|endofturn|]\n",
            "tool": lambda text: f"[|tool|]{_trim(text)}[|endofturn|]\n",
        },
        "[|assistant|]",
    ),
    N.EXAONE_MOE: _by_role(
        {
            role: _wrapped(f"<|{role}|>\n", "<|endofturn|>\n")
            for role in ("system", "user", "assistant", "tool")
        },
        "<|assistant|>\n",
    ),
    N.RWKV_WORLD: _rwkv_world,
    N.GRANITE: _granite3,
    N.GRANITE_4_0: _granite4,
    N.GRANITE_4_1: _granite4,
    N.GIGACHAT: _gigachat,
    N.MEGREZ: _each(
        lambda role, text: f"<|role_start|>{role}<|role_end|>{text}<|turn_end|>",
        "<|role_start|>assistant<|role_end|>",
    ),
    N.YANDEX: _by_role(
        {
            "user": lambda text: f" Пользователь: {text}\n\n",
            "assistant": lambda text: f" Ассистент: {text}\n\n",
        },
        " Ассистент:[SEP]",
    ),
    N.BAILING: _bailing(think=False),
    N.BAILING_THINK: _bailing(think=True),
    N.BAILING2: _bailing2,
    N.LLAMA4: _header(
        "<|header_start|>", "<|header_end|>\n\n", "<|eot|>", "<|header_start|>assistant<|header_end|>\n\n"
    ),
    N.SMOLVLM: _each(
        lambda role, text: (
            text + "\n\n"
            if role == "system"
            else f"User: {text}<end_of_utterance>\n"
            if role == "user"
            else f"Assistant: {text}<end_of_utterance>\n"
        ),
        "Assistant:",
        prefix="<|im_start|>",
    ),
    N.HUNYUAN_MOE: _hunyuan_moe,
    N.GPT_OSS: _each(
        lambda role, text: (
            f"<|start|>{role}<|message|>{text}" + ("<|return|>" if role == "assistant" else "<|end|>")
        ),
        "<|start|>assistant",
    ),
    N.HUNYUAN_DENSE: _hunyuan_dense,
    N.HUNYUAN_VL: _hunyuan_vl,
    N.KIMI_K2: _kimi_k2,
    N.SEED_OSS: _each(
        lambda role, text: f"<seed:bos>{role}\n{_trim(text) if role == 'assistant' else text}<seed:eos>",
        "<seed:bos>assistant\n",
    ),
    N.GROK_2: _by_role(
        {
            "system": lambda text: f"System: {_trim(text)}<|separator|>\n\n",
            "user": lambda text: f"Human: {_trim(text)}<|separator|>\n\n",
            "assistant": lambda text: f"Assistant: {text}<|separator|>\n\n",
        },
        "Assistant:",
    ),
    N.PANGU_EMBEDDED: _pangu_embedded,
    N.SOLAR_OPEN: _each(lambda role, text: f"<|begin|>{role}<|content|>{text}<|end|>", "<|begin|>assistant"),
}
