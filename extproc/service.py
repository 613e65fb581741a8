"""One ext_proc stream per HTTP request: headers, body, decision, response status, close.

Envoy keeps the gRPC stream open until the HTTP stream ends, so the stream's end is the request's
completion: in-flight accounting is released in `finally`, exactly once, whether the request
finished, failed, or the client went away. Any unexpected error fails open (the request goes on to
Envoy's default route) and is counted; the server never dies on input.

Two request body modes, told apart by the protocol_config of the first message: BUFFERED (one
body message, answered on its own) and FULL_DUPLEX_STREAMED (the endpoint-picker protocol: body
chunks stream in without waiting, and the router answers the headers only once the body is whole).
Decisions, metrics and error answers are the same in both.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from extproc import messages
from extproc.kv_events import PromptWarmer
from extproc.telemetry import RouterMetrics, parse_traceparent
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gorgo._xds.envoy.service.ext_proc.v3.external_processor_pb2_grpc import (
    ExternalProcessorServicer,
)
from gorgo.core.contract import (
    ATTEMPT_COUNT_HEADER,
    BODY_PATHS,
    MODELS_PATH,
    OUTCOME_ATTR,
    ROUTER_STATUS_ATTR,
    SPAN_PREFIX,
    decision_fields,
    request_fields,
)
from gorgo.core.decimals import whole_number
from gorgo.core.decision import SHED, UNKNOWN_MODEL, Decision, Rejection, next_best
from gorgo.core.features import RequestError, RequestFeatures, extract_features
from gorgo.core.fleet import FleetSpec
from gorgo.core.membership import identity
from gorgo.core.router import Router

log = logging.getLogger("gorgo.extproc")
# The request messages that FULL_DUPLEX_STREAMED mode answers differently (see _on_duplex).
_DUPLEX_KINDS = frozenset({"request_headers", "request_body", "request_trailers"})


def _decides(kind: str | None, req: pb.ProcessingRequest, duplex: bool) -> bool:
    """Whether this message may bring the routing decision: a buffered body, the last of a
    streamed one (or its trailers), or headers with no body to follow."""
    if kind == "request_body":
        return not duplex or req.request_body.end_of_stream
    if kind == "request_headers":
        return req.request_headers.end_of_stream
    return kind == "request_trailers" and duplex


class _Stream:
    """Per-request state carried between the messages of one ext_proc stream."""

    __slots__ = ("answered", "chunks", "decided_at", "decision", "duplex", "fallback",
                 "fallback_id", "headers", "opened", "path", "served", "served_id", "size",
                 "status", "stream", "trace")
    # The replicas are kept by name and identity: a fleet reload may re-index them mid-stream,
    # or point a name at another replica (`_replica`).

    def __init__(self) -> None:
        self.opened = False  # the request's headers were read (from either message)
        self.headers: dict[str, str] = {}
        self.path = "/"
        self.decision: Decision | None = None
        self.decided_at = 0.0  # perf_counter() when decided
        self.served = ""  # the replica that answered: the decision's, or the retry's
        self.served_id: tuple[str, ...] = ()
        self.stream = False  # the request asked for a streamed answer
        self.status = ""  # the response's, once its headers came through the router
        self.fallback: str | None = None  # the replica Envoy retries on, if any
        self.fallback_id: tuple[str, ...] = ()
        # (trace id, span id) of Envoy's ext_proc span, when decision spans are exported
        self.trace: tuple[bytes, bytes] | None = None
        # FULL_DUPLEX_STREAMED only: the body so far, and whether the request is answered.
        self.duplex = False
        self.chunks: list[bytes] = []
        self.size = 0
        self.answered = False


def _routed_by_body(path: str) -> bool:
    """Whether a request to ``path`` is routed by what its body says (an inference path)."""
    return path.split("?", 1)[0] in BODY_PATHS


def models_body(spec: FleetSpec) -> dict[str, Any]:
    """`GET /v1/models` answered from the fleet: the models its replicas serve, in OpenAI's list
    format (aliases are names a model also answers to, not models of their own)."""
    return {"object": "list", "data": [
        {"id": m, "object": "model", "created": 0, "owned_by": spec.name} for m in spec.models]}


class Unreadable:
    """A message of Envoy's that does not parse (`read_request`): answered, never a gRPC error."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def read_request(data: bytes) -> pb.ProcessingRequest | Unreadable:
    """Envoy's message, parsed leniently: with the request headers skipped, the headers the
    router reads come as string attributes, which protobuf refuses when a client's header value
    is not UTF-8. As a gRPC error that failed the request open, past shedding, the model check
    and the booking; as `Unreadable` it gets the router's 400."""
    try:
        return pb.ProcessingRequest.FromString(data)
    except DecodeError as exc:
        return Unreadable(str(exc))


def register(service: ExtProcService, server: Any) -> None:
    """Serve ``service`` as Envoy's ExternalProcessor on ``server`` (grpc.aio), its messages
    parsed by `read_request`."""
    handlers = {"Process": grpc.stream_stream_rpc_method_handler(
        service.Process, request_deserializer=read_request,
        response_serializer=pb.ProcessingResponse.SerializeToString)}
    name = pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


class ExtProcService(ExternalProcessorServicer):
    def __init__(self, router: Router, metrics: RouterMetrics, clock=time.monotonic) -> None:
        self.router = router
        self.metrics = metrics
        self.clock = clock
        # Envoy's streams that still await an answer of the router (a stream stays open after
        # its last message until the response ends, minutes for a long answer), and when the
        # last one opened (monotonic): what a drain waits on.
        self.pending_streams = 0
        self.last_opened = 0.0
        # The precise cache view tokenizes the rest of each prompt off the request path.
        self._warm = PromptWarmer(router.state.precise) if router.state.precise else None
        self.reloaded()

    def reloaded(self) -> None:
        """Take on the router's fleet (at start, and after each reload)."""
        spec = self.router.spec
        self.max_body = spec.limits.max_body_bytes
        self.limits = spec.limits
        self.picker = spec.endpoint_picker
        self.retries = spec.retries.enabled
        self._models = models_body(spec) if spec.models else None

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        st = _Stream()
        self.pending_streams += 1
        pending = True
        self.last_opened = time.monotonic()
        if self.metrics.spans.enabled and context is not None:
            st.trace = parse_traceparent(next(
                (m.value for m in context.invocation_metadata() or () if m.key == "traceparent"),
                None))
        try:
            async for req in request_iterator:
                if isinstance(req, Unreadable):
                    if not st.answered:  # Envoy closes the stream on the answer
                        st.answered = True
                        yield self._reject(RequestError(
                            400, "A request header the router reads is not valid UTF-8.",
                            code="invalid_header"))
                    continue
                kind = req.WhichOneof("request")
                if req.HasField("protocol_config"):  # Envoy 1.34+ sends it on the first message
                    st.duplex = req.protocol_config.request_body_mode == messages.FULL_DUPLEX
                if not st.answered and _decides(kind, req, st.duplex):
                    # This router's turn among its peers (shared bookings; 0 otherwise); the
                    # router's own answer to /v1/models books nothing and waits for no turn.
                    hold = self.router.stagger_s(self.clock())
                    if hold > 0.0 and not (kind == "request_headers" and self._decides_nothing(
                            messages.header_dict(req.request_headers))):
                        await asyncio.sleep(hold)
                if st.duplex and kind in _DUPLEX_KINDS:
                    for answer in self._on_duplex(st, kind, req):
                        yield answer
                elif kind == "request_headers":
                    yield self._on_request_headers(st, req.request_headers)
                elif kind == "request_body":
                    yield self._on_request_body(st, req)
                elif kind == "response_headers":
                    yield self._on_response_headers(st, req.response_headers)
                elif kind == "request_trailers":
                    yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                elif kind == "response_trailers":
                    yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
                elif kind == "response_body":
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse())
                if pending and not st.duplex and self._last_message(kind, req):
                    pending = False
                    self.pending_streams -= 1
        finally:
            if pending:
                self.pending_streams -= 1
            if st.decision is not None:
                later = self._held_past_close(st)
                if later > 0.0:
                    asyncio.get_running_loop().call_later(later, self.router.complete,
                                                          st.decision.id)
                else:
                    self.router.complete(st.decision.id)
                served = self._replica(st.served, st.served_id)
                if served is not None:  # else removed: its label sets are gone
                    m = self.metrics
                    m.labelled(m.request_seconds, *m.replica(served)).observe(
                        time.perf_counter() - st.decided_at)

    def _held_past_close(self, st: _Stream) -> float:
        """Seconds a request's booking outlives its stream: in full-duplex mode with the
        response trailers skipped (the default), Envoy closes the stream once nothing more can
        be sent to the router, while the answer still runs (its booking ended there: 9
        concurrent streams went to one replica). At the response headers, a streamed answer
        still decodes: its predicted decoding time (nothing for an answer already whole, or an
        error). With the response headers skipped too, right after the request: its predicted
        first token and decoding (every request looked finished once routed). Within the
        request timeout."""
        spec = self.router.spec
        d = st.decision
        if not (st.duplex and d is not None and spec.extproc.response_trailers == "skip"):
            return 0.0
        decode_ms = d.terms.get("decode", 0.0)
        if st.status:
            held_ms = decode_ms if st.stream and st.status[:1] == "2" else 0.0
        elif spec.extproc.skip_response_headers:
            held_ms = d.predicted_ms + decode_ms
        else:
            held_ms = 0.0  # the response headers never came: the request failed
        return min(held_ms / 1000.0, spec.timeouts.request_s) if held_ms > 0.0 else 0.0

    def _last_message(self, kind: str | None, req: pb.ProcessingRequest) -> bool:
        """Whether the message just answered is the last Envoy sends the router: the response
        headers, or with those skipped, the end of the request. (Not in full-duplex mode: Envoy
        may still send the response trailers there, and a stream closed before the response
        ends fails it; such a stream holds a drain until it closes.)"""
        if kind == "response_headers":
            return True
        if not self.router.spec.extproc.skip_response_headers:
            return False
        if kind == "request_headers":
            return req.request_headers.end_of_stream
        if kind == "request_body":
            return req.request_body.end_of_stream
        return kind == "request_trailers"

    # --- message handlers ---------------------------------------------------------------------

    def _open(self, st: _Stream, headers: dict[str, str]) -> pb.ProcessingResponse | None:
        """Take the request's headers: the router's own answer to /v1/models, else None."""
        st.opened = True
        st.headers = headers
        st.path = headers.get(":path", "/")
        if self._lists_models(headers):
            return messages.immediate(200, self._models, "gorgo_models")
        return None

    def _decides_nothing(self, headers: dict[str, str]) -> bool:
        """Whether a request without a body is passed on with no decision: the router's own
        model list, or an inference path with nothing to route by."""
        return self._lists_models(headers) or _routed_by_body(headers.get(":path", "/"))

    def _lists_models(self, headers: dict[str, str]) -> bool:
        """Whether the router answers this request itself, with the fleet's model list."""
        # Only a GET or HEAD: another method (a browser's CORS preflight) is routed on its
        # headers, for the engine to answer as it does alone (the list came without the engine's
        # access-control-allow-* headers). A config forwarding no :method reads as a GET.
        return (self._models is not None and headers.get(":method", "GET") in ("GET", "HEAD")
                and headers.get(":path", "/").split("?", 1)[0] == MODELS_PATH)

    def _on_request_headers(self, st: _Stream, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        if st.decision is not None:  # a second request on a stream: decided once (Envoy sends
            return messages.CONTINUE_REQUEST_HEADERS  # none; booking again leaked the first)
        answer = self._open(st, messages.header_dict(msg))
        if answer is not None:
            return answer
        length = st.headers.get("content-length", "")
        size = whole_number(length)
        if size is not None and size > self.max_body:
            return self._reject(RequestError(
                413, f"Request body of {size} bytes exceeds the limit of {self.max_body}.",
                code="request_too_large"))
        if msg.end_of_stream:  # no body will follow
            if _routed_by_body(st.path):
                # Nothing to route by (a CORS preflight, a GET, an empty POST through a gateway
                # that sends every method here): passed on unrouted, for the engine to answer
                # as it would alone (it was the router's 400 "Request body is empty").
                return messages.CONTINUE_REQUEST_HEADERS
            return self._decide(st, b"", on_headers=True)  # on the headers alone
        return messages.CONTINUE_REQUEST_HEADERS

    def _on_request_body(self, st: _Stream, req: pb.ProcessingRequest) -> pb.ProcessingResponse:
        if not st.opened:  # extproc.request_headers: skip: the headers came as its attributes
            answer = self._open(st, messages.attribute_headers(req))
            if answer is not None:
                return answer
        # One decision, one booking per request: a body chunk after the decision (STREAMED mode,
        # or a body after headers that ended the stream) goes on as it is.
        if st.decision is not None:
            return messages.CONTINUE_REQUEST_BODY
        msg = req.request_body
        if len(msg.body) > self.max_body:
            return self._too_large()
        return self._decide(st, msg.body, on_headers=False)

    def _on_duplex(
        self, st: _Stream, kind: str, req: pb.ProcessingRequest
    ) -> list[pb.ProcessingResponse]:
        """FULL_DUPLEX_STREAMED: Envoy streams the body without waiting for the headers answer and
        drains it, so every answer waits until the body is whole; then, in Envoy's required order,
        the headers answer (route, metadata), the body handed back, the trailers answer."""
        if st.answered:  # an error answer ended the request; Envoy is closing the stream
            return []
        if kind == "request_headers":
            msg = req.request_headers
            answer = self._on_request_headers(st, msg)
            if msg.end_of_stream or answer.HasField("immediate_response"):
                st.answered = True
                return [answer]
            return []
        if kind == "request_body":
            st.chunks.append(req.request_body.body)
            st.size += len(req.request_body.body)
            if st.size > self.max_body:
                st.answered = True
                return [self._too_large()]
            if not req.request_body.end_of_stream:
                return []
        st.answered = True
        trailers = kind == "request_trailers"
        body = b"".join(st.chunks)
        # Envoy (to 1.40 at least, envoyproxy/envoy#45470) replays its retry buffer with the
        # trailers and sends the body upstream twice: a request with trailers takes no retry.
        head = self._decide(st, body, on_headers=True, retry=not trailers)
        if head.HasField("immediate_response"):
            return [head]
        # A body answer without a body message is out of order for Envoy: none when none came.
        out = [head, *(messages.stream_body(body, not trailers) if st.chunks else [])]
        st.chunks = []  # handed back: not held while the response streams (minutes)
        if trailers:
            out.append(messages.CONTINUE_REQUEST_TRAILERS)
        return out

    def _on_response_headers(self, st: _Stream, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        d = st.decision
        if d is None:
            return messages.CONTINUE_RESPONSE_HEADERS
        if st.status:  # counted once: a second message (Envoy sends none) charged failures again
            return messages.tag_response(st.served, d.id)
        headers = messages.header_dict(msg)
        status = st.status = headers.get(":status", "")
        s = self.router.state
        chosen = self._replica(st.served, st.served_id)  # None: removed since the decision
        attempts = whole_number(headers.get(ATTEMPT_COUNT_HEADER, "1"))
        if st.fallback is not None and attempts is not None and attempts > 1:
            # Envoy retried on the next-best replica: the chosen one failed before answering.
            if chosen is not None:
                s.record_failed_response(chosen, self.clock())
                self.metrics.retried.labels(*self.metrics.replica(chosen)).inc()
            st.served, st.served_id = st.fallback, st.fallback_id
            fallback = self._replica(st.fallback, st.fallback_id)
            if fallback is not None:
                self.router.reassign(d.id, fallback)
        served = self._replica(st.served, st.served_id)
        if served is not None:
            m = self.metrics
            m.labelled(m.upstream_status, *m.replica(served), f"{status[:1]}xx").inc()
            if status in ("500", "502", "503", "504"):
                s.record_failed_response(served, self.clock())
            elif status[:1] in ("2", "4"):
                s.record_good_response(served)
        return messages.tag_response(st.served, d.id)

    def _replica(self, name: str, ident: tuple[str, ...]) -> int | None:
        """The index of replica ``name`` if it is still the one the stream was sent to: None
        once a reload removed it or pointed the name at another address (a new replica, which
        must not be credited with the old one's answers, failures or load)."""
        s = self.router.state
        i = s.index.get(name)
        return i if i is not None and identity(s.spec.replicas[i]) == ident else None

    # --- decisions ------------------------------------------------------------------------------

    def _decide(self, st: _Stream, body: bytes, *, on_headers: bool,
                retry: bool = True) -> pb.ProcessingResponse:
        t0 = time.perf_counter()
        wall0 = time.time_ns() if st.trace is not None else 0
        try:
            f = extract_features(st.path, st.headers, body, self.router.state.tok,
                                 policies=self.router.policies, limits=self.limits)
            d = self.router.route(f, self.clock())
        except RequestError as err:
            self._span(st, t0, wall0,
                       {OUTCOME_ATTR: "invalid_request", ROUTER_STATUS_ATTR: err.status})
            return self._reject(err)
        except Exception:
            return self._fail_open(st, t0, wall0, on_headers)
        if isinstance(d, Rejection):
            self._span(st, t0, wall0, {OUTCOME_ATTR: d.reason, ROUTER_STATUS_ATTR: d.status})
            return self._refuse(d)
        st.decision, st.stream = d, f.stream
        try:
            return self._answer(st, f, d, on_headers, retry, t0, wall0)
        except Exception:  # the decision cannot be told to Envoy: released, never half-booked
            self.router.complete(d.id)
            st.decision = None
            return self._fail_open(st, t0, wall0, on_headers)

    def _fail_open(self, st: _Stream, t0: float, wall0: int,
                   on_headers: bool) -> pb.ProcessingResponse:
        log.exception("routing failed; failing open to the default route")
        self.metrics.fail_open.inc()
        self._span(st, t0, wall0, {OUTCOME_ATTR: "fail_open"}, error=True)
        return messages.CONTINUE_REQUEST_HEADERS if on_headers else messages.CONTINUE_REQUEST_BODY

    def _answer(self, st: _Stream, f: RequestFeatures, d: Decision, on_headers: bool,
                retry: bool, t0: float, wall0: int) -> pb.ProcessingResponse:
        """The routing answer for decision ``d``: route, headers, metadata, metrics, span;
        ``retry``: whether it may name the next-best replica for Envoy's retry route."""
        s = self.router.state
        st.served, st.served_id = s.names[d.replica], identity(s.spec.replicas[d.replica])
        if self._warm is not None:
            self._warm.submit(f)
        replica, region = self.metrics.replica(d.replica)
        fields = {**decision_fields(d, replica, region),
                  **request_fields(f, s.spec.replicas[d.replica].engine)}
        endpoint = s.spec.replicas[d.replica].address if self.picker else None
        fallback = next_best(d) if self.retries and retry else None
        st.fallback, st.fallback_id = (None, ()) if fallback is None else (
            s.names[fallback], identity(s.spec.replicas[fallback]))
        # Only with a routable next-best replica: a one-address list would leave the retry to
        # Envoy's fallback round robin, which may pick the failed or an ejected replica.
        endpoints = None if fallback is None else [
            s.spec.replicas[d.replica].address, s.spec.replicas[fallback].address]
        answer = (messages.route_on_headers if on_headers else messages.route_on_body)(
            s.clusters[d.replica], fields, endpoint, endpoints)
        m = self.metrics
        m.labelled(m.decisions, d.policy, replica, region, m.model(f.model)).inc()
        st.decided_at = time.perf_counter()
        m.labelled(m.decision_seconds, d.policy).observe(st.decided_at - t0)
        # The decision id stays on Envoy's span of the same trace: the tuner reads a span with
        # one as a request.
        if st.trace is not None:
            attrs = {OUTCOME_ATTR: "routed", **{SPAN_PREFIX + k: v for k, v in fields.items()
                                                if k != "decision_id"}}
            if "stream" in fields:  # typed on the router's own span: it is no Envoy tag
                attrs[SPAN_PREFIX + "stream"] = f.stream
            self._span(st, t0, wall0, attrs)
        return answer

    def _span(self, st: _Stream, t0: float, wall0: int, attrs: dict[str, Any],
              error: bool = False) -> None:
        """The router's span of this decision (DecisionSpans), if Envoy traced the stream."""
        if st.trace is not None:
            elapsed_ns = int((time.perf_counter() - t0) * 1e9)
            self.metrics.spans.record(st.trace, wall0, wall0 + elapsed_ns, attrs, error)

    def _refuse(self, r: Rejection) -> pb.ProcessingResponse:
        """The router's rejection as Envoy's immediate response, with Retry-After unless retrying
        cannot help (a 400)."""
        if r.reason == SHED:
            self.metrics.shed.labels(str(r.priority if r.priority is not None else "default")).inc()
            err = RequestError(429, r.message, type="overloaded_error", code="overloaded")
        else:
            self.metrics.rejected.labels(str(r.status)).inc()
            kind = "server_error" if r.status >= 500 else "invalid_request_error"
            err = RequestError(r.status, r.message, type=kind, code=r.reason,
                               param="model" if r.reason == UNKNOWN_MODEL else None)
        # Retry-After only where waiting can help: an overload or an outage, never a bad request.
        retry = {"retry-after": f"{r.retry_after_s:.0f}"} if r.status in (429, 503) else {}
        return messages.immediate(r.status, err.to_body(), f"gorgo_{r.reason}", retry)

    def _too_large(self) -> pb.ProcessingResponse:
        return self._reject(RequestError(
            413, f"Request body exceeds the limit of {self.max_body} bytes.",
            code="request_too_large"))

    def _reject(self, err: RequestError) -> pb.ProcessingResponse:
        self.metrics.rejected.labels(str(err.status)).inc()
        return messages.immediate(err.status, err.to_body(), f"gorgo_{err.status}")
