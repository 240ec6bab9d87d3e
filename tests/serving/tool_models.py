"""A tiny checkpoint whose chat template renders tools and writes calls in the hermes format (<tool_call> JSON, as
Qwen's does), for the tool-call tests (a helper of tests/serving/test_tools.py)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

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
