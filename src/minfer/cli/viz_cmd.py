"""`minfer viz [MODEL]`: a web page over the live graph (`minfer.viz`), or `--trace FILE` for a
trace saved by MINFER_TRACE=FILE.

One process: uvicorn serving the page, its locally vendored assets and the JSON endpoints.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from minfer.cli.common import add_model_args, model_options
from minfer.errors import MinferError

if TYPE_CHECKING:
    from minfer.viz.session import VizSession


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("viz", help="web page over the compute graph and a traced generation",
                       description="Serve a page that draws the prefill and decode graphs and "
                                   "traces a generation node by node.")
    p.add_argument("model", nargs="?", help="model path or cached name (default model if omitted)")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8081, help="port (default 8081)")
    p.add_argument("--trace", metavar="FILE", help="open a saved trace instead of a model")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from minfer.viz.session import VizSession, load_trace

    if not 0 < args.port < 65536:
        raise MinferError("--port must be in 1..65535")
    model_arg = args.model or args.model_opt
    if args.model and args.model_opt:
        raise MinferError("model given twice")
    if args.trace:
        if model_arg:
            raise MinferError("give a model or --trace FILE, not both")
        session = VizSession(trace=load_trace(args.trace))
        what = args.trace
    else:
        from minfer.api import Model
        from minfer.tools.fetch import resolve

        path = resolve(model_arg)
        session = VizSession(model=Model(path, **model_options(args)))
        what = path.name
    return serve(session, host=args.host, port=args.port, what=what)


def serve(session: VizSession, *, host: str, port: int, what: str) -> int:
    import uvicorn

    from minfer.viz.app import create_app

    print(f"minfer: viz of {what} on http://{host}:{port}/", file=sys.stderr, flush=True)
    uvicorn.run(create_app(session), host=host, port=port, log_level="warning")
    return 0
