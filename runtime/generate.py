"""`tandem generate [MODEL] "prompt"`: one completion on the command line."""

from __future__ import annotations

import argparse

from runtime.plan import add_engine_arguments, engine_options


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="complete a prompt (default model: the one shipped with Tandem)")
    parser.add_argument("args", nargs="+", metavar="[MODEL] PROMPT", help="optional model directory, then the prompt")
    add_engine_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kernel-backend", choices=("auto", "torch", "triton"), default="auto",
                        help="triton kernels on CUDA, torch references elsewhere (default auto)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if len(args.args) > 2:
        raise ValueError(f"expected [MODEL] PROMPT, got {len(args.args)} arguments; quote the prompt")
    model, prompt = (None, args.args[0]) if len(args.args) == 1 else args.args
    # Imported here: the engine needs torch, and `tandem plan` must not.
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    llm = LLM(model, **engine_options(args), max_model_len=args.max_model_len, kernel_backend=args.kernel_backend)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    print(prompt + output.outputs[0].text)
    return 0
