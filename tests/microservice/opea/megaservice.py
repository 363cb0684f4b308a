"""A GenAIComps megaservice around Wick's LLM microservice, built from opea-comps' own classes
the way ChatQnA builds its own: a `ServiceOrchestrator` per graph, remote `MicroService` nodes,
and a `MicroService` in the MEGASERVICE role as the gateway. It runs under the opea-comps venv
(`env.py`), never the test venv: `python megaservice.py '<json config>'`.

Config: `{"port": P, "graphs": {name: {"llm": URL, "adapters": bool, "reranker": bool,
"downstream": bool, "embedding": URL, "reranking": URL}}, "corpus": [...]}`. Graphs: [embedding
-> retriever -> reranking ->] [reranker ->] llm [-> downstream]. `adapters` gives the
orchestrator ChatQnA's output adapters (they read OpenAI JSON and chunks from the LLM node);
without them it is the plain orchestrator, which feeds a downstream node itself.

Routes (besides comps' own /v1/health_check):
- POST /v1/chatqna: the gateway, as ChatQnA's: a ChatCompletionRequest becomes LLMParams and
  the initial inputs of graph `chat` (or `rag` when it has `documents`).
- POST /v1/test/schedule: `{"graph", "inputs", "params"}` ->
  `schedule(inputs, LLMParams(**params))`; a StreamingResponse is passed through, else
  `{"result": <the last leaf's output>}`.
- POST /v1/test/rerank: the stand-in reranker node: SearchedDoc in, LLMParamsDoc's `query` and
  `documents` out, best (here: last retrieved) first.
- POST /v1/test/downstream: the stand-in next node (a guardrail): records and echoes `text`.
- POST /v1/test/retrieve: the stand-in retriever (graphs with `embedding` and `reranking`
  URLs: Wick's embedding and reranking microservices): EmbedDoc in, the config's `corpus`
  ranked by the embedding out, as a SearchedDoc (`top_n` 2).
- GET /v1/test/received: what the downstream node received so far (then forgets it).
"""

from __future__ import annotations

import json
import sys
from typing import Any
from urllib.parse import urlsplit

from comps import MicroService, ServiceOrchestrator, ServiceRoleType, ServiceType
from comps.cores.proto.api_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    UsageInfo,
)
from comps.cores.proto.docarray import LLMParams
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse


class ChatQnAOrchestrator(ServiceOrchestrator):
    """ChatQnA's output adapters (its align_outputs/align_generator, as ChatQnA patches them
    into ServiceOrchestrator): the LLM node's answer is read as OpenAI JSON or chunks."""

    def align_outputs(self, data, cur_node, inputs, runtime_graph, llm_parameters_dict, **kw):
        if (
            self.services[cur_node].service_type == ServiceType.LLM
            and not llm_parameters_dict["stream"]
        ):
            return {"text": data["choices"][0]["message"]["content"]}
        return data

    def align_generator(self, gen, **kwargs):
        for line in gen:
            line = line.decode("utf-8")
            json_str = line[line.find("{") : line.rfind("}") + 1]
            try:
                choice = json.loads(json_str)["choices"][0]
                if choice["finish_reason"] != "eos_token" and "content" in choice["delta"]:
                    yield f"data: {choice['delta']['content'].encode('utf-8')!r}\n\n"
            except Exception:
                yield f"data: {json_str.encode('utf-8')!r}\n\n"
        yield "data: [DONE]\n\n"


def remote(name: str, url: str, endpoint: str, service_type: ServiceType) -> MicroService:
    parts = urlsplit(url)
    return MicroService(
        name=name,
        host=parts.hostname,
        port=parts.port,
        endpoint=endpoint,
        use_remote_service=True,
        service_type=service_type,
    )


def build_graph(spec: dict[str, Any], self_url: str) -> ServiceOrchestrator:
    orchestrator = ChatQnAOrchestrator() if spec.get("adapters") else ServiceOrchestrator()
    llm = remote("llm", spec["llm"], "/v1/chat/completions", ServiceType.LLM)
    orchestrator.add(llm)
    if spec.get("embedding"):
        # ChatQnA's whole graph: embedding -> retriever (the stand-in) -> reranking -> llm.
        embed = remote("embedding", spec["embedding"], "/v1/embeddings", ServiceType.EMBEDDING)
        retrieve = remote("retriever", self_url, "/v1/test/retrieve", ServiceType.RETRIEVER)
        rerank = remote("rerank", spec["reranking"], "/v1/reranking", ServiceType.RERANK)
        for node in (embed, retrieve, rerank):
            orchestrator.add(node)
        orchestrator.flow_to(embed, retrieve)
        orchestrator.flow_to(retrieve, rerank)
        orchestrator.flow_to(rerank, llm)
    if spec.get("reranker"):
        rerank = remote("rerank", self_url, "/v1/test/rerank", ServiceType.RERANK)
        orchestrator.add(rerank)
        orchestrator.flow_to(rerank, llm)
    if spec.get("downstream"):
        guard = remote("guardrail", self_url, "/v1/test/downstream", ServiceType.GUARDRAIL)
        orchestrator.add(guard)
        orchestrator.flow_to(llm, guard)
    return orchestrator


def gateway_params(request: ChatCompletionRequest, stream: bool) -> LLMParams:
    """ChatQnA's LLMParams from the client's request (its `x or default` idiom)."""
    return LLMParams(
        max_tokens=request.max_tokens or 1024,
        top_k=request.top_k or 10,
        top_p=request.top_p or 0.95,
        temperature=request.temperature or 0.01,
        frequency_penalty=request.frequency_penalty or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        repetition_penalty=request.repetition_penalty or 1.03,
        stream=stream,
        chat_template=request.chat_template or None,
        model=request.model or None,
    )


def main(config: dict[str, Any]) -> None:
    port = int(config["port"])
    self_url = f"http://127.0.0.1:{port}"
    graphs = {name: build_graph(spec, self_url) for name, spec in config["graphs"].items()}
    received: list[str] = []

    async def run(graph: str, inputs: dict[str, Any], params: LLMParams) -> Any:
        result, runtime_graph = await graphs[graph].schedule(
            initial_inputs=inputs, llm_parameters=params
        )
        for response in result.values():
            if isinstance(response, StreamingResponse):
                return response
        return result[runtime_graph.all_leaves()[-1]]

    async def chatqna(request: Request) -> Any:
        data = await request.json()
        stream = data.get("stream", True)
        chat = ChatCompletionRequest.model_validate(data)
        params = gateway_params(chat, stream)
        if chat.documents:
            question = chat.messages if isinstance(chat.messages, str) else chat.messages[-1]
            question = question if isinstance(question, str) else question["content"]
            retrieved = [{"text": d} for d in chat.documents]
            inputs = {"initial_query": question, "retrieved_docs": retrieved}
            answer = await run("rag", inputs, params)
        else:
            answer = await run("chat", {"messages": chat.messages}, params)
        if isinstance(answer, StreamingResponse):
            return answer
        choice = ChatCompletionResponseChoice(
            index=0,
            message=ChatMessage(role="assistant", content=answer["text"]),
            finish_reason="stop",
        )
        return ChatCompletionResponse(model="chatqna", choices=[choice], usage=UsageInfo())

    async def schedule(request: Request) -> Any:
        body = await request.json()
        answer = await run(body["graph"], body["inputs"], LLMParams(**body.get("params", {})))
        return answer if isinstance(answer, StreamingResponse) else JSONResponse({"result": answer})

    async def rerank(request: Request) -> Any:
        body = await request.json()
        docs = [d["text"] for d in body["retrieved_docs"]]
        return JSONResponse({"query": body["initial_query"], "documents": docs[::-1]})

    async def retrieve(request: Request) -> Any:
        # The stand-in retriever: an EmbedDoc in, config["corpus"] ({"text", "embedding"},
        # normalized) by dot product with its embedding out, as a SearchedDoc of the best k.
        doc = await request.json()
        query = doc["embedding"]
        received.append(f"retriever got {len(query)} dims")
        corpus = sorted(
            config.get("corpus", []),
            key=lambda c: -sum(a * b for a, b in zip(c["embedding"], query, strict=True)),
        )
        retrieved = [{"text": c["text"]} for c in corpus[: doc.get("k", 4)]]
        return JSONResponse({"retrieved_docs": retrieved, "initial_query": doc["text"], "top_n": 2})

    async def downstream(request: Request) -> Any:
        text = (await request.json())["text"]
        received.append(text)
        return JSONResponse({"text": text})

    async def take_received() -> Any:
        taken = list(received)
        received.clear()
        return JSONResponse(taken)

    service = MicroService(
        "chatqna",
        service_role=ServiceRoleType.MEGASERVICE,
        host="127.0.0.1",
        port=port,
        endpoint="/v1/chatqna",
        input_datatype=ChatCompletionRequest,
        output_datatype=ChatCompletionResponse,
    )
    service.add_route("/v1/chatqna", chatqna, methods=["POST"])
    service.add_route("/v1/test/schedule", schedule, methods=["POST"])
    service.add_route("/v1/test/rerank", rerank, methods=["POST"])
    service.add_route("/v1/test/downstream", downstream, methods=["POST"])
    service.add_route("/v1/test/retrieve", retrieve, methods=["POST"])
    service.add_route("/v1/test/received", take_received, methods=["GET"])
    service.start()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
