"""Fixtures of tests/serving: the tiny pair whose chat template writes hermes tool calls, loaded and served on
loopback once for the session (test_tools.py, test_responses.py)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.serving.tool_models import TOOL_MODEL, TOOL_TOKENS, with_tool_template


@pytest.fixture(scope="session")
def tool_runtime(tiny_pair, tiny_perturbed_draft, tiny_root):
    """tiny_pair's target with tiny_perturbed_draft, both with the hermes tool template (budget 16, fp32)."""
    from specexec.config import EngineConfig
    from specexec.runtime.assembly import Runtime

    target = with_tool_template(tiny_root / "pair-target-tools", tiny_pair[0])
    draft = with_tool_template(tiny_root / "pair-draft-tools", tiny_perturbed_draft)
    return Runtime.load(str(target), str(draft), EngineConfig(budget=16, dtype="float32", max_new_tokens=TOOL_TOKENS))


@pytest.fixture(scope="session")
def tool_server(tool_runtime) -> Iterator[tuple[str, Any]]:
    """(base URL, an openai.OpenAI client) of tool_runtime served as TOOL_MODEL."""
    pytest.importorskip("uvicorn")
    from tests.serving.live_server import served

    with served(tool_runtime, TOOL_MODEL, TOOL_TOKENS) as pair:
        yield pair


@pytest.fixture
def tool_url(tool_server) -> str:
    return tool_server[0]


@pytest.fixture
def tool_client(tool_server):
    return tool_server[1]
