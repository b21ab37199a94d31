"""The soak's throwaway PostgreSQL server: it starts on its own port with a password, loses no
committed row when it is crashed and started again, and leaves nothing behind."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, text

from ops.soak.postgres import ThrowawayPostgres
from tests.helpers import free_port
from tests.ops.soak.test_soak import postgres_programs

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def test_a_crashed_throwaway_server_comes_back_with_every_committed_row():
    postgres_programs()
    pg = ThrowawayPostgres(None, os_user="postgres", port=free_port())
    try:
        url = pg.start()
        assert url.startswith("postgresql+psycopg://flywheel:") and f"@127.0.0.1:{pg.port}/postgres" in url
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE t (x int)"))
            conn.execute(text("INSERT INTO t VALUES (1), (2)"))
        took = pg.restart(down_s=0.5)  # -m immediate: no checkpoint, WAL recovery at start
        assert took >= 0
        engine.dispose()  # its pooled connections died with the server
        with engine.connect() as conn:
            assert conn.execute(text("SELECT sum(x) FROM t")).scalar() == 3
        engine.dispose()
        wrong = create_engine(url.replace("flywheel:", "flywheel:x"))
        with pytest.raises(Exception, match="password"):
            wrong.connect()
        folder = pg.folder
    finally:
        pg.close()
    assert not folder.exists()
