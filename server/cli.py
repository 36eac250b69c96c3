"""`kvserve serve [MODEL]` and `kvserve bench ...`: options, logging, model loading behind a 503 /health,
and graceful SIGTERM/Ctrl-C shutdown (stop accepting, drain in-flight requests, exit 0)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from engine import (
    LoRAError,
    ShuttingDownError,
    StartupError,
    model_id,
    set_openmp_wait_policy,
)
from server.logging_setup import configure_logging
from server.models_registry import check_adapter_names
from server.settings import (
    add_serve_arguments,
    build_configs,
    build_ray_config,
    check_lora_modules,
    resolve,
)

if TYPE_CHECKING:
    from engine import EngineClient, EngineConfig
    from server.state import ServerConfig

logger = logging.getLogger("kvserve")

LOAD_THREAD = "kvserve-load"  # the daemon thread that loads the engine


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve", description="A small OpenAI-compatible LLM server."
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    commands = parser.add_subparsers(dest="command")
    serve = commands.add_parser(
        "serve",
        # short: argparse prints the usage above every bad-option error (--help lists them all)
        usage="kvserve serve [MODEL] [options]  (kvserve serve --help lists them)",
        help="serve a model over the OpenAI API",
        description="Serve a model over the OpenAI API. Every option can also be set by its environment "
        "variable or in the --config YAML file; precedence: CLI > environment > file > default.",
        formatter_class=argparse.HelpFormatter,
    )
    add_serve_arguments(serve)
    bench = commands.add_parser(
        "bench", help="benchmark a running server (see `kvserve bench --help`)", add_help=False
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from server.bench import main as bench_main

        return int(bench_main(argv[1:]) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from server.app import kvserve_version

        print(f"kvserve {kvserve_version()}")
        return 0
    if args.command != "serve":
        parser.print_help()
        return 2
    cli_values = {k: v for k, v in vars(args).items() if k not in ("command", "version")}
    try:
        values = resolve(cli_values)
        engine_config, server_config = build_configs(values)
        ray_config = build_ray_config(values)
        base = server_config.served_model_name or model_id(engine_config)
        check_lora_modules(engine_config.lora, base)
    except ValueError as e:
        parser.exit(2, f"kvserve serve: error: {e}\n")
    configure_logging(server_config.log_level)
    logger.info("%s", set_openmp_wait_policy())
    if ray_config.enabled:
        from server.distributed.launch import serve_on_ray

        return serve_on_ray(values, ray_config, server_config)
    loop_factory = _event_loop_factory()
    if loop_factory is None or sys.version_info < (3, 11):  # asyncio.Runner is 3.11's
        code = asyncio.run(serve(engine_config, server_config))
    else:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            code = runner.run(serve(engine_config, server_config))
    if any(t.name == LOAD_THREAD and t.is_alive() for t in threading.enumerate()):
        # Stopped while the model still loads: the interpreter's own exit would tear down what the
        # loading thread is using inside native code (C++ aborts the process: exit 134), so leave
        # now; nothing was started that needs closing.
        logger.info("exiting while the model was still loading")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it is installed (uvicorn[standard] brings it on Linux), as uvicorn and vLLM run:
    its transports and scheduling cost less per streamed token (measured: the event loop's CPU per
    token 7% lower at 256 streams); else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _load_in_daemon_thread(engine_config: EngineConfig) -> asyncio.Future[EngineClient]:
    """Load the engine off the event loop in a daemon thread (a shutdown never waits for a half load)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[EngineClient] = loop.create_future()

    def settle(result: EngineClient | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        elif result is not None:
            future.set_result(result)

    def load() -> None:
        try:
            from engine import AsyncLLMEngine

            engine: EngineClient = AsyncLLMEngine.from_config(engine_config)
        except BaseException as e:  # noqa: BLE001 - handed to the loop
            loop.call_soon_threadsafe(settle, None, e)
            return
        loop.call_soon_threadsafe(settle, engine, None)

    threading.Thread(target=load, name=LOAD_THREAD, daemon=True).start()
    return future


def _bind_error(host: str, port: int) -> str:
    """Why host:port cannot be listened on (a plain bind tried again), for the log line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as e:
        return str(e)
    return "the server could not bind it (see the line above)"


async def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    import uvicorn

    from server.app import build_app

    app = build_app(server_config)
    state = app.state.server
    logger.info("event loop: %s", type(asyncio.get_running_loop()).__module__.split(".")[0])
    uv_config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_config=None,
        lifespan="off",
        timeout_graceful_shutdown=2,
        timeout_keep_alive=5,
    )
    try:
        sock = uv_config.bind_socket()
    except (OSError, SystemExit) as e:  # uvicorn logs the OSError, then exits with a bare code
        reason = (
            str(e)
            if isinstance(e, OSError)
            else _bind_error(server_config.host, server_config.port)
        )
        logger.error("cannot listen on %s:%s: %s", server_config.host, server_config.port, reason)
        return 1
    server = _Server(uv_config)
    exit_code = 0

    exiting_now = False  # a second signal came: end what runs and exit (exit_now)

    async def drain() -> None:
        """Stop taking requests (503), give in-flight ones up to shutdown_timeout, then stop uvicorn."""
        state.draining = True
        deadline = time.monotonic() + server_config.shutdown_timeout
        if state.in_flight:
            logger.info(
                "shutting down: waiting up to %.0fs for %d request(s)",
                server_config.shutdown_timeout,
                state.in_flight,
            )
        while state.in_flight and time.monotonic() < deadline and not exiting_now:
            await asyncio.sleep(0.05)
        if state.in_flight and not exiting_now:
            await end_requests("drain time ran out", "shutdown timeout", 2.0)
        server.should_exit = True

    async def end_requests(reason: str, why: str, wait: float) -> None:
        """End what still runs as its API ends a failure (a 503, or an in-band error event once
        streaming), its engine work aborted; wait up to `wait` s for those responses to go out."""
        ended = state.engine.fail_all(ShuttingDownError(reason)) if state.engine else 0
        logger.warning("%s: ending %d request(s) (%d in the engine)", why, state.in_flight, ended)
        stop = time.monotonic() + wait
        while state.in_flight and time.monotonic() < stop:
            await asyncio.sleep(0.02)

    async def exit_now(name: str) -> None:
        await end_requests("stopped by a second signal", f"second {name}", 0.5)
        server.force_exit = True
        server.should_exit = True

    def on_signal(sig: int) -> None:
        nonlocal exiting_now
        if state.draining:
            if not exiting_now:
                exiting_now = True
                asyncio.ensure_future(exit_now(signal.Signals(sig).name))
            return
        logger.info("received %s: shutting down gracefully", signal.Signals(sig).name)
        state.draining = True
        asyncio.ensure_future(drain())

    server.on_signal = on_signal
    serve_task = asyncio.create_task(server.serve(sockets=[sock]))
    loading = _load_in_daemon_thread(engine_config)
    bundled = "all-MiniLM-L6-v2" if engine_config.model.task == "embed" else "SmolLM2-135M-Instruct"
    logger.info("loading model %s ...", engine_config.model.model or f"(bundled {bundled})")
    if server_config.allow_runtime_lora_updating and server_config.api_key is None:
        logger.warning(
            "--allow-runtime-lora-updating without --api-key: any client can load LoRA adapters "
            "from this machine's disk"
        )
    started = time.monotonic()
    done, _ = await asyncio.wait({serve_task, loading}, return_when=asyncio.FIRST_COMPLETED)
    if loading in done and not state.draining:
        try:
            engine = loading.result()
            check_adapter_names(engine, server_config.served_model_name or engine.model_name)
            await engine.start()
        except Exception as e:  # noqa: BLE001 - one clear line, then exit 1
            if isinstance(e, StartupError):  # the message names the part (kv events, draft, tiers)
                logger.error("could not start: %s", e)
            else:
                what = (
                    "a LoRA adapter (--lora-modules)" if isinstance(e, LoRAError) else "the model"
                )
                logger.error("could not load %s: %s", what, e)
            logger.debug("traceback", exc_info=True)
            exit_code = 1
            server.should_exit = True
        else:
            state.engine = engine
            # What start-up loaded lives as long as the server: frozen out of the collector's sight,
            # a full collection no longer walks its ~300k objects (a 10-20 ms pause inside a step).
            gc.collect()
            gc.freeze()
            if engine.loras():
                names = ", ".join(info.name for info in engine.loras())
                logger.info("serving LoRA adapters: %s (select one by `model`)", names)
            logger.info(
                "model %s loaded in %.1fs (max_model_len %d); serving on http://%s:%d",
                state.model_name,
                time.monotonic() - started,
                engine.max_model_len,
                server_config.host,
                server_config.port,
            )
    await serve_task
    if state.engine is not None:
        with contextlib.suppress(Exception):
            await state.engine.shutdown()
    logger.info("bye")
    return exit_code


class _Server:
    """uvicorn.Server whose SIGINT/SIGTERM start our drain instead of uvicorn's immediate close."""

    def __new__(cls, config: Any) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            on_signal: Any = None

            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                loop = asyncio.get_running_loop()

                def handler(sig: int, frame: Any) -> None:
                    loop.call_soon_threadsafe(self.on_signal, sig)

                originals = {
                    sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)
                }
                try:
                    yield
                finally:
                    for sig, original in originals.items():
                        signal.signal(sig, original)

        return Server(config)


if __name__ == "__main__":
    sys.exit(main())
