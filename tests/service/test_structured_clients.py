"""instructor and LangChain asking the embedded model for pydantic objects, as their users do: every mode
and method, within the libraries' default limits, against the shared default server.

Their schemas leave additionalProperties out; read literally, the model added key after key until max_tokens
(instructor's IncompleteOutputException, LangChain's None and LengthFinishReasonError). JSON mode and
json_mode only ask for "a JSON object", so what fills it is the model's: the prompt shows the fields, as a user
of those modes does (given only the schema in instructor's system message, the 135M model copies the schema).
One prompt serves every mode."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel

from tests.server_process import ServerProcess

MODEL = "tokenmill"
PROMPT = 'Alice is 31 years old. Answer with {"name": ..., "age": ...}.'


class Person(BaseModel):
    name: str
    age: int


class WeatherQuery(BaseModel):
    """The weather in a city."""

    city: str
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def chat_model(server: ServerProcess) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=server.http_url + "/v1", api_key="none", temperature=0, max_retries=0)


@pytest.mark.parametrize("mode", ["JSON", "TOOLS", "JSON_SCHEMA"])
def test_instructor_gets_the_person_in_each_mode(client: openai.OpenAI, mode: str) -> None:
    import instructor

    patched = instructor.from_openai(client, mode=instructor.Mode[mode])
    person, completion = patched.chat.completions.create_with_completion(
        model=MODEL, response_model=Person, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_retries=0
    )
    assert isinstance(person, Person) and person.model_dump() == {"name": "Alice", "age": 31}, completion
    if mode == "TOOLS":
        assert len(completion.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("method", ["function_calling", "json_mode", "json_schema"])
def test_langchain_with_structured_output_gets_the_person_by_each_method(chat_model: Any, method: str) -> None:
    person = chat_model.with_structured_output(Person, method=method).invoke(PROMPT)
    assert isinstance(person, Person) and person.model_dump() == {"name": "Alice", "age": 31}


def test_langchain_bind_tools_with_a_named_function_gets_one_call(chat_model: Any) -> None:
    """A named tool_choice is called exactly once (the model wrote the same call three times when the grammar
    let it)."""
    message = chat_model.bind_tools([WeatherQuery], tool_choice="WeatherQuery").invoke("Weather in Rome in celsius?")
    (call,) = message.tool_calls
    assert call["name"] == "WeatherQuery" and WeatherQuery(**call["args"]).city == "Rome"


def test_a_schema_whose_closed_reading_admits_nothing_is_refused_with_the_reason(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Numbers."}],
            extra_body={"guided_json": {"type": "array", "minItems": 1}},
        )
    assert err.value.param == "guided_json" and "without items only its prefixItems" in err.value.message  # type: ignore[attr-defined]
