"""B15's peer: the server a user would write with Hugging Face transformers. `generate` with a
`TextIteratorStreamer` on a thread per request, behind a plain FastAPI app streaming OpenAI
`/v1/completions` chunks (text, then a last chunk with the usage).

It serves the same weights as the artifact: `gpt2_folder` writes the project's GPT checkpoint
as a GPT-2 folder (the same architecture: pre-norm blocks, tanh GELU, tied head; the inverse
of app/models/gpt.py:rename_gpt2) and checks that transformers computes the same logits.

    python -m bench.hf_peer --folder F --port P [--threads N]
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations.
import argparse
import json
import re
import threading
from typing import Any

EOS = "<|endoftext|>"


def gpt2_folder(checkpoint: str, folder: str) -> str:
    """The checkpoint's GPT as a Hugging Face GPT-2 folder (config, safetensors, tokenizer)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from app.models.gpt import CONV1D, rename_gpt2
    from app.train.checkpoint import load_checkpoint

    loaded = load_checkpoint(checkpoint)
    gpt, tokenizer = loaded.model, Tokenizer.from_str(loaded.preprocessor.state["tokenizer"])
    block = gpt.blocks[0]
    eos = tokenizer.token_to_id(EOS)
    config = GPT2Config(
        vocab_size=gpt.tokens.num_embeddings,
        n_positions=gpt.positions.num_embeddings,
        n_embd=gpt.tokens.embedding_dim,
        n_layer=len(gpt.blocks),
        n_head=block.attn.heads,
        n_inner=block.mlp[0].out_features,
        activation_function="gelu_new",
        layer_norm_epsilon=gpt.norm.eps,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    hf = GPT2LMHeadModel(config).eval()
    names = list(hf.state_dict())
    # rename_gpt2 on tensors marked with their index says where each of our tensors goes.
    marked = {n: torch.full(t.shape, float(i)) for i, (n, t) in enumerate(hf.state_dict().items())}
    ours = gpt.state_dict()
    state = {}
    for name, mark in rename_gpt2(marked).items():
        hf_name = names[int(mark.flatten()[0])]
        conv = re.fullmatch(CONV1D, hf_name.removeprefix("transformer."))
        state[hf_name] = ours[name].t().contiguous() if conv else ours[name]
    missing = hf.load_state_dict(state, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}, missing  # tied to wte
    ids = torch.arange(16).remainder(config.vocab_size)[None]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, gpt(ids), rtol=1e-4, atol=1e-4)
    hf.save_pretrained(folder)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS)
    fast.save_pretrained(folder)
    return folder


def app(folder: str) -> Any:
    import torch
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse
    from starlette.concurrency import iterate_in_threadpool
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    server = FastAPI()

    @server.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @server.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        ids = tokenizer(body["prompt"], return_tensors="pt").input_ids
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        generated: dict[str, int] = {}

        def run() -> None:
            try:
                generate()
            finally:  # a failed generate (a prompt too long) ends the stream, not hangs it
                streamer.end()

        def generate() -> None:
            torch.manual_seed(body.get("seed", 0))
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=body.get("max_tokens", 16),
                    do_sample=body.get("temperature", 1.0) > 0,
                    temperature=body.get("temperature", 1.0) or None,
                    top_k=0,
                    pad_token_id=tokenizer.eos_token_id,
                    streamer=streamer,
                )
            generated["tokens"] = out.shape[1] - ids.shape[1]

        thread = threading.Thread(target=run)
        thread.start()

        async def events():
            async for text in iterate_in_threadpool(streamer):
                if text:
                    yield _sse({"choices": [{"index": 0, "text": text, "finish_reason": None}]})
            thread.join()
            if "tokens" not in generated:
                yield _sse({"error": "generation failed"})
                return
            usage = {"prompt_tokens": ids.shape[1], "completion_tokens": generated["tokens"]}
            yield _sse(
                {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage}
            )
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return server


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def main() -> None:
    import torch
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    uvicorn.run(app(args.folder), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
