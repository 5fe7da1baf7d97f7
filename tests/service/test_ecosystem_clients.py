"""Clients no one here wrote, against the default server: lm-evaluation-harness's `local-completions`
(as its own command), LangChain's `ChatOpenAI`, LiteLLM, and the `openai` SDK's less common
parameters. Each answer is checked against the same request made through gRPC.

Their imports are slow, so they share this one module and the session's default server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.server_process import ServerProcess
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc

LM_EVAL = Path(sys.executable).parent / "lm_eval"

# A multiple-choice task (scored by loglikelihood) and a generation task, each read from a local file.
MULTIPLE_CHOICE = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Rome"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "five", "seven"], "answer": 0},
    {"question": "The sky on a clear day is", "choices": ["green", "blue"], "answer": 1},
]
GENERATION = [
    {"question": "Q: What is the capital of France?\nA:", "answer": " Paris"},
    {"question": "Q: What color is the sky?\nA:", "answer": " Blue"},
    {"question": "Q: How many legs does a dog have?\nA:", "answer": " Four"},
]
GEN_TOKENS = 8
TASKS = {
    "tiny_choice": """
task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "tiny_generate": """
task: tiny_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {tokens}
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
}


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def tokenize(stub: pb_grpc.GenerationStub, text: str) -> list[int]:
    return list(stub.Tokenize(pb.TokenizeRequest(text=text), timeout=30).ids)


# -- lm-evaluation-harness ----------------------------------------------------------------------


def grpc_loglikelihood(stub: pb_grpc.GenerationStub, context: str, continuation: str) -> tuple[float, bool]:
    """The score lm-eval computes, through gRPC: the continuation's tokens' logprobs given the context
    (the pair tokenized together, split where the context's own tokens end), and whether each is the
    most likely token."""
    context_ids, whole = tokenize(stub, context), tokenize(stub, context + continuation)
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=whole),
        stopping=pb.StoppingParams(max_new_tokens=1),
        prompt_logprobs=True,
        top_logprobs=1,
    )
    scored = list(next(iter(stub.Generate(request, timeout=600))).prompt_tokens)[len(context_ids) :]
    greedy = all(t.logprob == max(a.logprob for a in t.top_logprobs) for t in scored)
    return sum(t.logprob for t in scored), greedy


def grpc_generation(stub: pb_grpc.GenerationStub, prompt: str, stop: list[str]) -> str:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=tokenize(stub, prompt)),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingParams(max_new_tokens=GEN_TOKENS, stop=stop),
    )
    return "".join(r.text for r in stub.Generate(request, timeout=600))


def test_lm_eval_local_completions_scores_as_grpc_does(
    server: ServerProcess, stub: pb_grpc.GenerationStub, tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, rows in (("tiny_choice", MULTIPLE_CHOICE), ("tiny_generate", GENERATION)):
        data = tasks / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (tasks / f"{name}.yaml").write_text(TASKS[name].format(data=data, tokens=GEN_TOKENS))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    # lm-eval's defaults otherwise: it finds /tokenizer_info and sends token ids, batches of 2 prompts.
    model_args = f"base_url={server.http_url}/v1/completions,model=tokenmill,max_retries=1"
    command = [str(LM_EVAL), "--model", "local-completions", "--model_args", model_args, "--batch_size", "2"]
    command += ["--tasks", "tiny_choice,tiny_generate", "--include_path", str(tasks)]
    command += ["--output_path", str(tmp_path / "out"), "--log_samples"]
    run = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "Using remote tokenizer" in run.stderr

    def samples(task: str) -> list[dict[str, Any]]:
        (path,) = (tmp_path / "out").rglob(f"samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return sorted(rows, key=lambda r: r["doc_id"])

    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]

    correct = 0
    for row, doc in zip(samples("tiny_choice"), MULTIPLE_CHOICE, strict=True):
        expected = [grpc_loglikelihood(stub, doc["question"], " " + c) for c in doc["choices"]]
        got = [(float(score), greedy == "True") for ((score, greedy),) in row["resps"]]
        assert got == expected, doc["question"]
        correct += max(range(len(expected)), key=lambda i: expected[i][0]) == doc["answer"]
    assert results["tiny_choice"]["acc,none"] == pytest.approx(correct / len(MULTIPLE_CHOICE))

    matched = 0
    for row, doc in zip(samples("tiny_generate"), GENERATION, strict=True):
        # lm-eval adds the model's end-of-sequence text (from /tokenizer_info) to the stop strings.
        expected_text = grpc_generation(stub, doc["question"], ["\n", "<|im_end|>"])
        assert row["resps"] == [[expected_text]], doc["question"]
        matched += expected_text == doc["answer"]
    assert results["tiny_generate"]["exact_match,none"] == pytest.approx(matched / len(GENERATION))


def test_echo_keeps_a_generated_end_of_turn_so_the_prompts_positions_line_up(
    server: ServerProcess, stub: pb_grpc.GenerationStub
) -> None:
    """lm-eval asks for one token past the prompt and drops the last position: that token must be
    there even when it is a special one (here the model ends its turn)."""
    import openai

    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ]
    body = json.dumps({"messages": messages, "add_generation_prompt": False}).encode()
    request = urllib.request.Request(server.http_url + "/tokenize", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        ids = json.loads(answer.read())["tokens"]
    ids = ids[: ids.index(2, len(ids) - 3)]  # up to the answer's end, before its <|im_end|> (id 2)
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0) as client:
        reply = client.completions.create(
            model="tokenmill", prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0
        )
    (choice,) = reply.choices
    assert choice.finish_reason == "stop"  # the end of turn was generated
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == len(ids) + 1


# -- n > 1 ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def openai_client(server: ServerProcess) -> Iterator[Any]:
    import openai

    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0, timeout=600) as c:
        yield c


WEEKEND = "The best thing about the weekend is"


def grpc_choices(stub: pb_grpc.GenerationStub, n: int, **request: Any) -> list[str]:
    texts = [""] * n
    for response in stub.Generate(pb.GenerateRequest(n=n, **request), timeout=600):
        texts[response.index] += response.text
    return texts


def test_n_choices_of_a_completion_are_grpcs_reproducible_and_the_same_whatever_n(
    openai_client: Any, stub: pb_grpc.GenerationStub
) -> None:
    ask = {"model": "tokenmill", "prompt": WEEKEND, "max_tokens": 8, "temperature": 1.0, "seed": 5}
    ask["extra_body"] = {"ignore_eos": True}
    two = openai_client.completions.create(n=2, **ask)
    assert [c.index for c in two.choices] == [0, 1]
    texts = [c.text for c in two.choices]
    assert texts[0] != texts[1]  # each choice draws from its own random stream
    sampling = pb.SamplingParams(temperature=1.0, seed=5)
    stopping = pb.StoppingParams(max_new_tokens=8, ignore_eos=True)
    assert grpc_choices(stub, 2, prompt=WEEKEND, sampling=sampling, stopping=stopping) == texts
    one = openai_client.completions.create(n=1, **ask)
    assert one.choices[0].text == texts[0]
    assert [c.text for c in openai_client.completions.create(n=3, **ask).choices][:2] == texts
    # Usage counts the prompt once and every choice's tokens.
    assert (two.usage.prompt_tokens, two.usage.completion_tokens) == (one.usage.prompt_tokens, 16)

    streamed = [""] * 2
    for chunk in openai_client.completions.create(n=2, stream=True, **ask):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts

    # Two prompts with n = 2: prompt i's choice j is choice 2 * i + j.
    batch = openai_client.completions.create(**{**ask, "prompt": [WEEKEND, "Paris is"]}, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices[:2]] == texts
    other = openai_client.completions.create(**{**ask, "prompt": "Paris is"}, n=2)
    assert [c.text for c in batch.choices[2:]] == [c.text for c in other.choices]


def test_n_chat_choices_streamed_and_whole_agree(openai_client: Any) -> None:
    ask = {
        "model": "tokenmill",
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 11,
        "n": 2,
    }
    whole = openai_client.chat.completions.create(**ask)
    assert [c.index for c in whole.choices] == [0, 1]
    roles: dict[int, str] = {}
    streamed = [""] * 2
    finished = set()
    for chunk in openai_client.chat.completions.create(stream=True, **ask):
        for choice in chunk.choices:
            if choice.delta.role:
                roles[choice.index] = choice.delta.role
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert roles == {0: "assistant", 1: "assistant"} and finished == {0, 1}
    assert streamed == [c.message.content for c in whole.choices]
    assert whole.usage.completion_tokens > 0


# -- LangChain and LiteLLM ------------------------------------------------------------------------

COLOUR = [{"role": "user", "content": "Name a colour."}]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def grpc_chat(stub: pb_grpc.GenerationStub, messages: list[dict[str, str]], max_new_tokens: int) -> str:
    chat = pb.Messages(messages=[pb.ChatMessage(**m) for m in messages])
    request = pb.GenerateRequest(chat=chat, stopping=pb.StoppingParams(max_new_tokens=max_new_tokens))
    return "".join(r.text for r in stub.Generate(request, timeout=600))


def test_langchain_chat_openai_invokes_streams_and_batches(server: ServerProcess, stub: pb_grpc.GenerationStub) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=server.http_url + "/v1", api_key="none", model="tokenmill", temperature=0, max_tokens=8, max_retries=0
    )
    france, colour = grpc_chat(stub, FRANCE, 8), grpc_chat(stub, COLOUR, 8)
    answer = llm.invoke(FRANCE[0]["content"])
    assert answer.content == france and "Paris" in france
    assert answer.response_metadata["model_name"] and answer.usage_metadata is not None
    assert answer.usage_metadata["output_tokens"] > 0
    chunks = list(llm.stream(FRANCE[0]["content"]))
    assert "".join(str(c.content) for c in chunks) == france
    assert [m.content for m in llm.batch([FRANCE[0]["content"], COLOUR[0]["content"]])] == [france, colour]


def test_litellm_completion_and_text_completion(
    server: ServerProcess, stub: pb_grpc.GenerationStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read at import: no download of prices
    import litellm

    where = {"model": "openai/tokenmill", "api_base": server.http_url + "/v1", "api_key": "none"}
    reply = litellm.completion(messages=FRANCE, max_tokens=8, temperature=0, **where)
    assert reply.choices[0].message.content == grpc_chat(stub, FRANCE, 8)
    assert reply.usage.completion_tokens > 0
    streamed = litellm.completion(messages=FRANCE, max_tokens=8, temperature=0, stream=True, **where)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == grpc_chat(stub, FRANCE, 8)

    text = litellm.text_completion(prompt=WEEKEND, max_tokens=8, temperature=0, **where)
    request = pb.GenerateRequest(prompt=WEEKEND, stopping=pb.StoppingParams(max_new_tokens=8))
    assert text.choices[0].text == "".join(r.text for r in stub.Generate(request, timeout=600))
