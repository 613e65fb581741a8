"""Shared bookings over a real NATS server (`extproc/peers.py`): two routers in one loop, then a
router behind real Envoy whose bookings a second `gorgo extproc` process counts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import nats
import pytest

import tests.support.e2e as e2e
from extproc import peers as peers_mod
from extproc import service as service_mod
from extproc.peers import PeerLink
from extproc.telemetry import RouterMetrics
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gorgo.core.decision import Decision
from gorgo.core.features import extract_features
from gorgo.core.fleet import parse_fleet
from gorgo.core.peers import CLOSED, MAX_PEERS, OPENED, Booking, decode, hello
from gorgo.core.router import Router
from gorgo.harness.nats_proc import NatsProcess
from gorgo.harness.procs import GorgoProcess, LoopThread, wait_for
from tests.support.e2e import GorgoMetrics, chat, post, start_stack, stop_stack


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsProcess]:
    with NatsProcess() as server:
        yield server


def fleet(url: str) -> dict:
    return {"name": "shared", "regions": {"a": {}},
            "replicas": [{"name": f"r{i}", "region": "a", "address": f"127.0.0.1:{21000 + i}",
                          "engine": "sglang"} for i in range(3)],
            "sharing": {"nats": url}}


def routers(url: str) -> tuple[Router, Router]:
    spec = parse_fleet(fleet(url))
    return Router(spec, id_prefix="ra"), Router(spec, id_prefix="rb")


def request(router: Router, text: str):
    body = f'{{"model": "m", "messages": [{{"role": "user", "content": "{text}"}}]}}'.encode()
    return extract_features("/v1/chat/completions", {}, body, router.state.tok)


def linked(*rs: Router) -> tuple[LoopThread, list[PeerLink]]:
    """A loop for the routers' links, and their links (started by the test)."""
    return LoopThread(), [PeerLink(r, RouterMetrics(r.state, lambda: 0)) for r in rs]


def routed(router: Router, text: str) -> Decision:
    """The router's decision for a request of ``text`` (call on its loop, as the service does)."""
    d = router.route(request(router, text), 0.0)
    assert isinstance(d, Decision)
    return d


def test_each_router_counts_the_others_requests(nats_server: NatsProcess) -> None:
    a, b = routers(nats_server.url)
    lt, links = linked(a, b)
    try:
        for link in links:
            lt.run(link.start())
        assert wait_for(lambda: all(link.connected for link in links), 10)
        f = request(a, "shared prefix " * 200)

        async def route() -> Decision:
            d = a.route(f, 0.0)  # on the loop, as the ext_proc server routes
            assert isinstance(d, Decision)
            return d

        d = lt.run(route())
        assert wait_for(lambda: b.state.inflight_reqs.sum() == 1, 5)
        assert b.state.inflight_reqs[d.replica] == 1 and len(b.peers) == 1
        # Its blocks are in b's prefix index too: b's next request with that prefix finds them.
        assert b.state.matched_blocks(f)[d.replica] == len(f.block_hashes)
        assert a.state.inflight_reqs.sum() == 1 and len(a.peers) == 0  # its own, once

        async def complete() -> None:
            a.complete(d.id)

        lt.run(complete())
        assert wait_for(lambda: b.state.inflight_reqs.sum() == 0, 5)
        assert b.peers.applied == 2 and b.peers.ignored == 0
        assert links[0].sent >= 2 and links[1].received >= 2 and links[1].bad == 0
    finally:
        for link in links:
            lt.run(link.stop())
        lt.close()


@pytest.mark.slow
def test_sharing_resumes_after_the_server_restarts_with_the_closes_made_meanwhile() -> None:
    # What a router opened while the server was down is not replayed; what it closed is (a blip
    # of seconds left the peer counting the requests that ended in it for request_s).
    server = NatsProcess().start()
    a, b = routers(server.url)
    lt, links = linked(a, b)

    async def route(text: str) -> Decision:
        return routed(a, text)

    async def complete(d: Decision) -> None:
        a.complete(d.id)

    try:
        for link in links:
            lt.run(link.start())
        assert wait_for(lambda: all(link.connected for link in links), 10)
        ds = [lt.run(route(f"before the outage {k}")) for k in range(3)]
        assert wait_for(lambda: b.state.inflight_reqs.sum() == 3, 5)
        server.stop()
        assert wait_for(lambda: not any(link.connected for link in links), 10)
        for d in ds[:2]:
            lt.run(complete(d))
        lt.run(route("while the bus is down"))  # routed on its own bookings: no error, no wait
        assert a.state.inflight_reqs.sum() == 2 and a.outbox == []
        server = NatsProcess(server.port).start()
        assert wait_for(lambda: all(link.connected for link in links), 15)
        # Generous bounds: a loaded machine slows the reconnection's replay, never its outcome.
        assert wait_for(lambda: b.state.inflight_reqs.sum() == 1, 20) and len(b.peers) == 1
        lt.run(route("after the restart"))
        assert wait_for(lambda: b.state.inflight_reqs.sum() == 2, 20)
    finally:
        for link in links:
            lt.run(link.stop())
        lt.close()
        server.stop()


@pytest.mark.slow
def test_a_router_cut_off_alone_asks_for_the_closes_it_missed(nats_server: NatsProcess) -> None:
    # Core NATS keeps nothing for a subscriber that is away: the closes sent while one router's
    # connection was down (or, after a server restart, before it had resubscribed) reached it
    # never, and it counted those requests for request_s. Back, it sends a hello; the peer
    # answers with its recent closes, but not one whose request a retry has re-opened since.
    a, b = routers(nats_server.url)
    lt, links = linked(a, b)

    async def route(text: str) -> Decision:
        return routed(a, text)

    async def cut_b_then_close(ds: list[Decision], moved_to: int) -> None:
        assert links[1]._nc is not None
        links[1]._nc._transport.close()  # b's connection drops; a's stays
        for d in ds[:2]:
            a.complete(d.id)
        assert a.reassign(ds[2].id, moved_to)  # a retry: closed, re-opened elsewhere
        await links[0].flush()  # on the server before b is back

    try:
        for link in links:
            lt.run(link.start())
        assert wait_for(lambda: all(link.connected for link in links), 10)
        ds = [lt.run(route(f"before the cut {k}")) for k in range(3)]
        assert wait_for(lambda: b.state.inflight_reqs.sum() == 3, 5)
        moved_to = (ds[2].replica + 1) % 3
        lt.run(cut_b_then_close(ds, moved_to))
        assert wait_for(lambda: links[0].resent >= 1, 20)  # b came back and asked
        assert wait_for(lambda: b.state.inflight_reqs.sum() == 1, 10)
        # The retried request: its close was not re-sent (b missed the move, not the request).
        assert b.state.inflight_reqs[ds[2].replica] == 1 and len(b.peers) == 1
        assert a.state.inflight_reqs[moved_to] == 1
    finally:
        for link in links:
            lt.run(link.stop())
        lt.close()


def test_a_bad_message_is_dropped_whole(nats_server: NatsProcess) -> None:
    _, b = routers(nats_server.url)
    lt = LoopThread()
    link = PeerLink(b, RouterMetrics(b.state, lambda: 0))
    try:
        lt.run(link.start())
        assert wait_for(lambda: link.connected, 10)

        async def send(data: bytes) -> None:
            nc = await nats.connect(nats_server.url)
            await nc.publish(link.subject, data)
            await nc.drain()

        good = b'["ok", "open", "r1", 100, 100, []]'
        for data in (b"{not json", b'{"v": 1, "router": "x", "b": [["id", "open"]]}',
                     b'{"v": 1, "router": "x", "b": [' + good + b', ["id2", "open", "r1", -5, '
                     b'0, []]]}'):
            lt.run(send(data))
        assert wait_for(lambda: link.bad == 3, 5)
        assert b.state.inflight_reqs.sum() == 0  # the good booking of a bad message too
        lt.run(send(b'{"v": 1, "router": "x", "b": [' + good + b"]}"))
        assert wait_for(lambda: b.state.inflight_reqs[1] == 1, 5)
    finally:
        lt.run(link.stop())
        lt.close()


def test_hellos_are_answered_with_the_last_closes_at_most_max_peers_a_second(
        nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    # Whoever publishes on the subject cannot make a router re-send its closes without end.
    clock = [1000.0]
    monkeypatch.setattr(peers_mod, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    a, _ = routers(nats_server.url)
    lt = LoopThread()
    link = PeerLink(a, RouterMetrics(a.state, lambda: 0))

    async def route_and_close() -> Decision:
        d = a.route(request(a, "closed once"), 0.0)
        assert isinstance(d, Decision)
        a.complete(d.id)
        return d

    async def hellos(n: int, answers: int) -> list[bytes]:
        """Send n hellos (and one without a reply address); the answers, once ``answers`` came
        or the router has read every hello."""
        nc = await nats.connect(nats_server.url)
        got: list[bytes] = []

        async def answer(msg) -> None:
            got.append(msg.data)

        inbox = nc.new_inbox()
        await nc.subscribe(inbox + ".*", cb=answer)
        seen = link.received
        await nc.publish(link.subject, hello("x"))  # no reply address: nothing to answer
        for k in range(n):
            await nc.publish(link.subject, hello("x"), reply=f"{inbox}.{k}")
        await nc.flush()
        for _ in range(1000):
            if len(got) >= answers and link.received == seen + n + 1:
                break
            await asyncio.sleep(0.01)
        await nc.flush()
        await nc.drain()
        return got

    try:
        lt.run(link.start())
        assert wait_for(lambda: link.connected, 10)
        assert lt.run(hellos(3, 0)) == [] and link.resent == 0  # nothing closed: no answer
        d = lt.run(route_and_close())
        assert wait_for(lambda: link.sent >= 1, 5)  # the open and its close
        (only,) = lt.run(hellos(1, 1))
        assert [(b.decision_id, b.kind) for b in decode(only)] == [(d.id, CLOSED)]
        assert len(lt.run(hellos(MAX_PEERS + 50, MAX_PEERS - 1))) == MAX_PEERS - 1
        assert link.resent == MAX_PEERS  # the second's quota spent: the rest unanswered
        assert link.unanswered == 51
        clock[0] += peers_mod.RESEND_S + 1  # a new second, and the close too old to re-send
        assert lt.run(hellos(1, 0)) == [] and link.resent == MAX_PEERS
    finally:
        lt.run(link.stop())
        lt.close()


def test_answers_re_send_at_most_max_resent_per_s_closes_a_second_packed_once(
        nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    # 256 hellos a second each re-encoded a busy router's 3,000 closes: its loop was held about
    # 3 s of every 4, past Envoy's message timeout.
    monkeypatch.setattr(peers_mod, "time", SimpleNamespace(monotonic=lambda: 1000.0))
    monkeypatch.setattr(peers_mod, "MAX_RESENT_PER_S", 5)
    packed: list[int] = []
    real_pack = peers_mod.pack
    monkeypatch.setattr(peers_mod, "pack", lambda router, rows, size: (
        packed.append(len(rows)), real_pack(router, rows, size))[1])
    a, _ = routers(nats_server.url)
    lt = LoopThread()
    link = PeerLink(a, RouterMetrics(a.state, lambda: 0))

    async def two_closed() -> None:
        for k in range(2):
            d = a.route(request(a, f"closed {k}"), 0.0)
            assert isinstance(d, Decision)
            a.complete(d.id)

    async def hellos(n: int) -> None:
        nc = await nats.connect(nats_server.url)
        for k in range(n):
            await nc.publish(link.subject, hello("x"), reply=f"{nc.new_inbox()}.{k}")
        await nc.drain()

    try:
        lt.run(link.start())
        assert wait_for(lambda: link.connected, 10)
        lt.run(two_closed())
        assert wait_for(lambda: link.sent >= 1, 5)
        packed.clear()
        lt.run(hellos(3))
        assert wait_for(lambda: link.resent + link.unanswered == 3, 10)
        assert (link.resent, link.unanswered) == (2, 1)  # 2 + 2 closes; 2 more would be 6 > 5
        assert packed == [2]  # one answer, packed once, sent twice
    finally:
        lt.run(link.stop())
        lt.close()


def test_a_hello_is_answered_only_at_an_inbox(nats_server: NatsProcess) -> None:
    # A hello whose reply address was the fleet's subject made the router answer every router:
    # 100 such hellos a second made a peer decode 1.8M closes in 6 s.
    a, b = routers(nats_server.url)
    lt, links = linked(a, b)

    async def closed() -> None:
        a.complete(routed(a, "closed once").id)

    async def hello_to(reply: str) -> None:
        nc = await nats.connect(nats_server.url)
        await nc.publish(links[0].subject, hello("x"), reply=reply)
        await nc.drain()

    try:
        for link in links:
            lt.run(link.start())
        assert wait_for(lambda: all(link.connected for link in links), 10)
        lt.run(closed())
        assert wait_for(lambda: links[0].sent >= 1, 5)
        for reply in (links[0].subject, "elsewhere"):
            lt.run(hello_to(reply))
        assert wait_for(lambda: links[0].unanswered == 2, 10) and links[0].resent == 0
        lt.run(hello_to("_INBOX.asker"))
        assert wait_for(lambda: links[0].resent == 1, 10)
    finally:
        for link in links:
            lt.run(link.stop())
        lt.close()


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory: pytest.TempPathFactory,
                 nats_server: NatsProcess) -> Iterator[tuple[e2e.Stack, GorgoProcess]]:
    st = start_stack(tmp_path_factory.mktemp("shared"), n=2, sharing={"nats": nats_server.url})
    peer = GorgoProcess(["extproc", "--fleet", str(st.fleet_path), "--port", "0",
                         "--metrics-port", "0"], timeout=60)
    try:
        yield st, peer
    finally:
        peer.stop()
        stop_stack(st)


@pytest.mark.envoy
def test_a_peer_router_counts_requests_routed_behind_envoy(
        shared_stack: tuple[e2e.Stack, GorgoProcess]) -> None:
    st, peer = shared_stack

    def peer_metric(name: str) -> float:
        return GorgoMetrics(SimpleNamespace(extproc=peer)).total(name)  # type: ignore[arg-type]

    assert wait_for(lambda: peer_metric("gorgo_peers_connected") == 1, 15)
    assert wait_for(lambda: GorgoMetrics(st).total("gorgo_peers_connected") == 1, 15)
    slow = e2e.CHUNK_GAP_S
    e2e.CHUNK_GAP_S = 0.5  # a stream that stays open for a few seconds
    try:
        answer = asyncio.run_coroutine_threadsafe(
            post(st.url + "/v1/chat/completions", chat("counted by the peer"), {}), st.lt.loop)
        assert wait_for(lambda: peer_metric("gorgo_peer_open_bookings") == 1, 10)
        assert peer_metric("gorgo_inflight_requests") == 1  # counted as if it had routed it
        assert answer.result(30)[0] == 200
    finally:
        e2e.CHUNK_GAP_S = slow
    assert wait_for(lambda: peer_metric("gorgo_peer_open_bookings") == 0, 10)
    assert peer_metric("gorgo_inflight_requests") == 0


def _turn_taking_service(
    monkeypatch: pytest.MonkeyPatch, peer: str, doc: dict | None = None,
) -> tuple[service_mod.ExtProcService, list[float]]:
    """A service whose router has heard from ``peer`` (ranked before it when ``peer`` < "m"),
    and the holds it awaits."""
    router = Router(parse_fleet(doc or fleet("nats://127.0.0.1:4222")), id_prefix="m")
    router.share()
    router.apply_peer(Booking(peer, f"{peer}-1", OPENED, "r0", 5, 5), 0.0)
    router.apply_peer(Booking(peer, f"{peer}-1", CLOSED, "r0"), 0.0)
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(s: float) -> None:
        waits.append(s)
        await real_sleep(0)

    monkeypatch.setattr(service_mod.asyncio, "sleep", sleep)
    return service_mod.ExtProcService(router, RouterMetrics(router.state, lambda: 0),
                                      clock=lambda: 1.0), waits


def _process(svc: service_mod.ExtProcService,
             msgs: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    async def go() -> list[pb.ProcessingResponse]:
        async def it():
            for m in msgs:
                yield m
        return [a async for a in svc.Process(it(), None)]
    return asyncio.run(go())


@pytest.mark.parametrize(("peer", "held"), [("a", [0.002]), ("z", [])])
def test_the_service_holds_a_decision_for_its_routers_turn(
    monkeypatch: pytest.MonkeyPatch, peer: str, held: list[float],
) -> None:
    """A router ranked second among its live peers waits ``stagger_ms`` before it decides (the
    offline simulation's `Router.stagger_s`, awaited on the loop); ranked first, not at all."""
    svc, waits = _turn_taking_service(monkeypatch, peer)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    answers = _process(svc, [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders()),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))])
    assert answers[-1].HasField("request_body")  # routed after the wait
    assert waits == pytest.approx(held)  # the headers message decided nothing: no wait there


def test_the_routers_own_model_list_waits_for_no_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """GET /v1/models, which the router answers itself and books nothing for, is not held for
    the router's turn, nor an inference path without a body (passed on unrouted); any other
    headers-only request is decided by the router, and is."""
    doc = fleet("nats://127.0.0.1:4222")
    for r in doc["replicas"]:
        r["models"] = ["m"]
    svc, waits = _turn_taking_service(monkeypatch, "a", doc)  # ranked second: holds

    def headers_only(path: str) -> list[pb.ProcessingResponse]:
        hdrs = pb.HttpHeaders(end_of_stream=True)
        hdrs.headers.headers.add(key=":path", raw_value=path.encode())
        return _process(svc, [pb.ProcessingRequest(request_headers=hdrs)])

    listed = headers_only("/v1/models")
    assert listed[0].HasField("immediate_response") and waits == []
    bodiless = headers_only("/v1/chat/completions")  # a CORS preflight: the engine's to answer
    assert bodiless[0].HasField("request_headers") and waits == []
    assert not bodiless[0].request_headers.response.header_mutation.set_headers  # unrouted
    other = headers_only("/health")  # routed on its headers, after its turn
    assert other[0].HasField("request_headers") and waits == pytest.approx([0.002])


@pytest.mark.envoy
def test_a_stopped_router_closes_its_open_requests_for_the_peers(
        tmp_path: Path, nats_server: NatsProcess) -> None:
    # A rolling restart stopped the NATS link before the streams the stop cut had closed: the
    # peers counted the answers then streaming for request_s.
    st = start_stack(tmp_path, n=2, sharing={"nats": nats_server.url})
    peer = GorgoProcess(["extproc", "--fleet", str(st.fleet_path), "--port", "0",
                         "--metrics-port", "0"], timeout=60)

    def peer_metric(name: str) -> float:
        return GorgoMetrics(SimpleNamespace(extproc=peer)).total(name)  # type: ignore[arg-type]

    slow = e2e.CHUNK_GAP_S
    try:
        assert wait_for(lambda: peer_metric("gorgo_peers_connected") == 1, 15)
        assert wait_for(lambda: GorgoMetrics(st).total("gorgo_peers_connected") == 1, 15)
        e2e.CHUNK_GAP_S = 1.5  # an answer streaming for several seconds
        answer = asyncio.run_coroutine_threadsafe(
            post(st.url + "/v1/chat/completions", chat("streaming through a stop"), {}),
            st.lt.loop)
        # Generous waits: a loaded machine slows the stream and the drain, never the outcome
        # (10 s once ran out with three other test files sharing the 2 cores).
        assert wait_for(lambda: peer_metric("gorgo_peer_open_bookings") == 1, 30)
        st.extproc.stop()  # SIGTERM: the drain, then the stop
        assert wait_for(lambda: peer_metric("gorgo_peer_open_bookings") == 0, 30)
        assert peer_metric("gorgo_inflight_requests") == 0
        answer.result(30)
    finally:
        e2e.CHUNK_GAP_S = slow
        peer.stop()
        stop_stack(st)
