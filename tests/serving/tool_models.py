"""Tiny checkpoints whose chat templates render tools and write calls in a family's own format: hermes
(<tool_call> JSON, as Qwen's), GLM (<arg_key>/<arg_value> pairs) and gpt-oss's harmony, the last two with their
envelope as special tokens (helpers of tests/serving/test_tools.py, test_tool_grammars.py, test_responses.py)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

TOOL_MODEL, TOOL_TOKENS = "tiny-tools", 160        # the served name and default max_tokens of conftest.tool_server

HERMES_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}</tools>\nCall a function as <tool_call>\n{\"name\": <name>, \"arguments\": <object>}\n"
    "</tool_call>{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|assistant|>\n"
    "{% for call in message.tool_calls %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}{{ eos_token }}\n"
    "{% elif message.role == 'tool' %}<|user|>\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{{ eos_token }}\n"
    "{% else %}<|{{ message.role }}|>\n{{ message.content }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def with_tool_template(dest: Path, base: Path) -> Path:
    """A copy of the checkpoint `base` at `dest` whose chat template is HERMES_TEMPLATE, its context 2048 tokens
    (tool schemas are long in a byte-level vocabulary)."""
    if not (dest / "config.json").exists():
        shutil.copytree(base, dest, dirs_exist_ok=True)
        (dest / "chat_template.jinja").write_text(HERMES_TEMPLATE)
        config = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    return dest


def load_tool_runtime(root: Path, target: Path, draft: Path):
    """A Runtime of `target` drafted by `draft`, both copied under `root` with HERMES_TEMPLATE (budget 16, fp32,
    TOOL_TOKENS new tokens by default)."""
    from specexec.config import EngineConfig
    from specexec.runtime.assembly import Runtime

    target = with_tool_template(root / "pair-target-tools", target)
    draft = with_tool_template(root / "pair-draft-tools", draft)
    return Runtime.load(str(target), str(draft), EngineConfig(budget=16, dtype="float32", max_new_tokens=TOOL_TOKENS))


GLM_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call a function as <tool_call>name\n<arg_key>key</arg_key>\n<arg_value>value</arg_value>\n</tool_call>"
    "{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|assistant|>"
    "{% for call in message.tool_calls %}\n<tool_call>{{ call.function.name }}\n"
    "{% for k, v in call.function.arguments.items() %}<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v if v is string else v | tojson }}</arg_value>\n{% endfor %}</tool_call>{% endfor %}"
    "{{ eos_token }}\n"
    "{% elif message.role == 'tool' %}<|observation|>\n<tool_response>{{ message.content }}</tool_response>"
    "{{ eos_token }}\n"
    "{% else %}<|{{ message.role }}|>\n{{ message.content }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")

HARMONY_TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}}<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}{% for call in message.tool_calls %}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ call.function.name }} <|constrain|>json<|message|>"
    "{{ call.function.arguments | tojson }}<|call|>{% endfor %}"
    "{% elif message.role == 'tool' %}<|start|>functions.{{ message.name }} to=assistant<|channel|>commentary"
    "<|message|>{{ message.content }}<|end|>"
    "{% else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")

# each format's envelope pieces, added to the tokenizer as special tokens (as GLM's and gpt-oss's have them)
SPECIAL = {"glm": ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                   "<think>", "</think>"),
           "harmony": ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|call|>")}
TEMPLATES = {"glm": GLM_TEMPLATE, "harmony": HARMONY_TEMPLATE}


def with_special_tokens(dest: Path, base: Path, fmt: str, seed: int) -> Path:
    """A copy of the checkpoint `base` at `dest` whose tokenizer has `fmt`'s envelope as added special tokens
    (the model's vocabulary grown to match by transformers' resize_token_embeddings, new rows drawn with
    `seed`) and whose chat template writes `fmt`'s calls; context 2048 tokens."""
    if (dest / "config.json").exists():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL[fmt])})
    tok.chat_template = TEMPLATES[fmt]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.config.max_position_embeddings = 2048
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest
