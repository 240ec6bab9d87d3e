"""Fixtures of tests/serving: the tiny pair whose chat template writes hermes tool calls, loaded and served on
loopback once for the session (test_tools.py, test_responses.py)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from tests.serving.tool_models import TOOL_MODEL, TOOL_TOKENS, load_tool_runtime


@pytest.fixture(scope="session")
def tool_runtime(tiny_pair, tiny_perturbed_draft, tiny_root):
    """tiny_pair's target with tiny_perturbed_draft, both with the hermes tool template (budget 16, fp32)."""
    return load_tool_runtime(tiny_root, tiny_pair[0], tiny_perturbed_draft)


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


@dataclass
class WeatherAgent:
    """The OpenAI Agents SDK (`agents`) with one function tool, get_weather, that records each city it is called
    with in `seen`; an agent built on it answers with the tool's text (tool_use_behavior stop_on_first_tool)."""

    agents: Any
    seen: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        @self.agents.function_tool
        def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
            """The weather in a city."""
            self.seen.append(city)
            return f"It is sunny in {city}."

        self.tool = get_weather

    def agent(self, model: Any, settings: Any) -> Any:
        return self.agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[self.tool],
                                 model=model, model_settings=settings, tool_use_behavior="stop_on_first_tool")


@pytest.fixture
def weather_agent() -> WeatherAgent:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    return WeatherAgent(agents)
