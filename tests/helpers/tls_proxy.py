"""A TLS-terminating proxy on 127.0.0.1 in front of a plain HTTP service, as an operator puts one (nginx, a cloud load
balancer): a self-signed certificate for 127.0.0.1 and localhost made by the `openssl` command, one TLS version (1.3,
whose session tickets arrive after the handshake, or 1.2), and the bytes of each connection forwarded both ways by
asyncio in a thread of the test's process."""

import asyncio
import contextlib
import ssl
import subprocess
import threading
from pathlib import Path


def self_signed(folder: Path) -> tuple[Path, Path]:
    """(certificate, key) PEM files of a self-signed certificate for 127.0.0.1 and localhost, valid a day."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return cert, key


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError, ssl.SSLError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


@contextlib.contextmanager
def tls_proxy(upstream: str, cert: Path, key: Path, version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3):
    """Yields the https URL of a proxy speaking only TLS `version` that forwards each connection to `upstream`
    ("http://127.0.0.1:PORT"); after, ends its connections, stops it and closes its event loop."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.minimum_version = context.maximum_version = version
    host, port = upstream.removeprefix("http://").rsplit(":", 1)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    async def forward(client_reader, client_writer):
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(_pump(client_reader, up_writer), _pump(up_reader, client_writer))

    async def start():
        holder["server"] = await asyncio.start_server(forward, "127.0.0.1", 0, ssl=context)
        started.set()

    async def stop():
        # Every connection ends both ways (its pumps close their writers), so the service behind sees its clients
        # go and its own shutdown waits for none of them.
        holder["server"].close()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def run():
        loop.run_until_complete(start())
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield f"https://127.0.0.1:{holder['server'].sockets[0].getsockname()[1]}"
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
