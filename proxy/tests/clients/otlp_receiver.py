"""An OTLP/HTTP trace receiver for the tracing test: accepts POST /v1/traces in OTLP's JSON
encoding (or protobuf), checks each request against OpenTelemetry's own protobuf definitions
(the `opentelemetry-proto` package: unknown fields or wrong types are refused with 400, as a
collector refuses them), and writes every span it received as one JSON line to OUT.

    python otlp_receiver.py OUT      # prints "listening PORT", serves until killed
"""
import base64
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

OUT = sys.argv[1]


def ids_to_base64(node):
    """OTLP JSON writes trace and span ids as hex; protobuf's JSON mapping wants base64."""
    if isinstance(node, dict):
        for k, v in list(node.items()):
            if k in ("traceId", "spanId", "parentSpanId") and isinstance(v, str):
                node[k] = base64.b64encode(bytes.fromhex(v)).decode()
            else:
                ids_to_base64(v)
    elif isinstance(node, list):
        for v in node:
            ids_to_base64(v)


def value(v):
    for k in ("stringValue", "boolValue", "intValue", "doubleValue"):
        if v.HasField(k[:-5] + "_value"):
            return getattr(v, k[:-5] + "_value")
    return None


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        req = ExportTraceServiceRequest()
        try:
            if self.path != "/v1/traces":
                raise ValueError(f"path {self.path}")
            if self.headers.get("content-type", "").startswith("application/json"):
                doc = json.loads(body)
                ids_to_base64(doc)
                json_format.ParseDict(doc, req)  # strict: unknown fields are errors
            else:
                req.ParseFromString(body)
        except Exception as e:  # noqa: BLE001 - any refusal is the test's failure
            with open(OUT, "a") as f:
                f.write(json.dumps({"error": str(e)}) + "\n")
            self.send_response(400)
            self.end_headers()
            return
        with open(OUT, "a") as f:
            for rs in req.resource_spans:
                service = {a.key: value(a.value) for a in rs.resource.attributes}.get("service.name")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        f.write(json.dumps({
                            "service": service,
                            "scope": ss.scope.name,
                            "name": s.name,
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(),
                            "kind": s.kind,
                            "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano,
                            "status": s.status.code,
                            "attributes": {a.key: value(a.value) for a in s.attributes},
                        }) + "\n")
        out = b"{}"
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print("listening", server.server_address[1], flush=True)
server.serve_forever()
