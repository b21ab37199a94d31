"""Property-based fuzzing over the OpenAPI schema (schemathesis): no input yields a 5xx.

The app is the API as `flywheel serve` serves it: serving's routes and the ops route groups."""

import schemathesis
from hypothesis import HealthCheck, given, settings

from ops.routes import ops_routers
from tests.serving.conftest import TOKEN, make_client


def test_no_server_errors_on_any_operation(tok):
    client, _, _ = make_client(tok, routers=[make() for make in ops_routers()])
    schema = schemathesis.openapi.from_asgi("/openapi.json", client.app)
    schema.validate()  # against the OpenAPI 3.1 schema
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/events", "/v1/health", "/ops/dashboard"}
    seen = {}

    for op in operations:

        @given(case=op.as_strategy())
        @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call(headers={"Authorization": f"Bearer {TOKEN}"})
            seen.setdefault(case.path, set()).add(response.status_code)
            assert response.status_code < 500, (
                f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}"
            )

        check()
    # The fuzzer reached both accepted and refused inputs on the write endpoints.
    assert any(c < 300 for c in seen["/v1/completions"]) and any(400 <= c < 500 for c in seen["/v1/completions"])
