-- The PostgreSQL store's schema: tables and functions, created on first use (see schema.rs).
-- `Q_` stands for the schema-qualified table prefix (`"public".redlease_` by default) and
-- `C_` for the notification channel, both filled in by the backend. Every time is the
-- server's clock (`clock_timestamp()`, which moves within a statement), never a client's.

CREATE TABLE IF NOT EXISTS Q_meta (
  id int PRIMARY KEY,
  version int NOT NULL
);

-- One row per lock name, never deleted: the fencing counter outlives every lease.
CREATE TABLE IF NOT EXISTS Q_lock (
  key bytea PRIMARY KEY,   -- the lease key's bytes (a name may hold any character, NUL too)
  token text,              -- the token of the last grant; NULL once released
  expires_at timestamptz,  -- the lease is held while this is ahead of the server's clock
  n bigint NOT NULL DEFAULT 0,          -- send number: the acquire that granted or renewed
                                        -- `token`'s lease, or the release that ended it
  fence bigint NOT NULL DEFAULT 0,      -- the last fencing token: never goes backwards
  label bytea,                          -- the holder's public label (UTF-8)
  released text,                        -- the token whose release ended the last lease
  released_n bigint NOT NULL DEFAULT 0, -- that release's send number
  waiters_until timestamptz             -- until when waiters want a notification
);

-- Abandoned attempts: a late copy of one (a statement still running on the server after its
-- connection dropped) is never granted.
CREATE TABLE IF NOT EXISTS Q_barred (
  token text PRIMARY KEY,
  key bytea NOT NULL,
  until timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS P_barred_until ON Q_barred (until);

-- One plain acquire attempt, in one round trip. Returns (1, fence) when granted (or already
-- ours: the same fence again), (0, ms left) when held by another, (0, -1) when free but not
-- ours to take (registered waiters go first, or a late or barred copy).
CREATE OR REPLACE FUNCTION Q_acquire(
  k bytea, tok text, ttl_ms bigint, wait_ms bigint, arriving boolean, floor_ bigint,
  lbl bytea, sn bigint, OUT code int, OUT val bigint)
LANGUAGE plpgsql AS $$
DECLARE
  r Q_lock%ROWTYPE;
  now_ timestamptz;
  clock_us bigint;
BEGIN
  INSERT INTO Q_lock (key) VALUES (k) ON CONFLICT (key) DO NOTHING;
  -- Serialises every operation on the name; what follows reads after the lock is taken,
  -- so an abandon that committed while this waited is seen.
  SELECT * INTO r FROM Q_lock WHERE key = k FOR UPDATE;
  now_ := clock_timestamp();
  clock_us := floor(extract(epoch FROM now_) * 1000000)::bigint;
  IF r.token = tok AND r.expires_at > now_ THEN
    -- Ours already: a repeated attempt. Renewed, same fence.
    UPDATE Q_lock SET expires_at = greatest(expires_at, now_ + ttl_ms * interval '1 ms'),
      n = greatest(n, sn) WHERE key = k;
    code := 1; val := r.fence; RETURN;
  END IF;
  IF EXISTS (SELECT 1 FROM Q_barred b WHERE b.token = tok AND b.until > now_)
     OR (r.token = tok AND r.n > sn) OR (r.released = tok AND r.released_n > sn) THEN
    -- Abandoned, or a late copy sent before a later operation of the same token.
    code := 0; val := -1; RETURN;
  END IF;
  IF r.token IS NOT NULL AND r.expires_at > now_ THEN
    IF wait_ms > 0 THEN
      UPDATE Q_lock SET waiters_until = greatest(coalesce(waiters_until, now_),
        now_ + wait_ms * interval '1 ms') WHERE key = k;
    END IF;
    code := 0;
    val := greatest(1, ceil(extract(epoch FROM (r.expires_at - now_)) * 1000))::bigint;
    RETURN;
  END IF;
  IF arriving AND r.waiters_until > now_ THEN
    -- Registered waiters go first; the flag is not refreshed on a newcomer's account.
    code := 0; val := -1; RETURN;
  END IF;
  val := greatest(r.fence + 1, clock_us, least(floor_, clock_us + 2000000));
  UPDATE Q_lock SET token = tok, expires_at = now_ + ttl_ms * interval '1 ms', n = sn,
    fence = val, label = lbl WHERE key = k;
  code := 1;
END $$;

-- Gives a plain lease back: 1 when `tok` held it (also for a re-sent release of it), else
-- 0. An abandon also bars the token, so that a late copy of its acquire is never granted.
-- A release notifies the channel (delivered at commit) while waiters are registered.
CREATE OR REPLACE FUNCTION Q_release(k bytea, tok text, sn bigint, abandon boolean)
RETURNS int LANGUAGE plpgsql AS $$
DECLARE
  r Q_lock%ROWTYPE;
  now_ timestamptz;
BEGIN
  IF abandon THEN
    INSERT INTO Q_lock (key) VALUES (k) ON CONFLICT (key) DO NOTHING;
  END IF;
  SELECT * INTO r FROM Q_lock WHERE key = k FOR UPDATE;
  now_ := clock_timestamp();
  IF abandon THEN
    INSERT INTO Q_barred (token, key, until) VALUES (tok, k, now_ + interval '300 s')
      ON CONFLICT (token) DO UPDATE SET until = EXCLUDED.until;
    IF random() < 0.01 THEN
      DELETE FROM Q_barred WHERE until < now_;
    END IF;
  END IF;
  IF NOT FOUND THEN
    RETURN 0;
  END IF;
  IF r.token = tok AND r.expires_at > now_ AND (abandon OR r.n < sn) THEN
    UPDATE Q_lock SET token = NULL, expires_at = NULL, label = NULL, released = tok,
      released_n = sn, n = sn WHERE key = k;
    IF r.waiters_until > now_ THEN
      -- The key in hex (a payload is text, under 8000 bytes): `*` wakes every waiter for a
      -- key too long for it.
      PERFORM pg_notify('C_', CASE WHEN length(k) <= 3000 THEN encode(k, 'hex') ELSE '*' END);
    END IF;
    RETURN 1;
  END IF;
  IF r.released = tok AND NOT abandon THEN
    RETURN 1;
  END IF;
  RETURN 0;
END $$;

-- Extends many plain leases in one statement: returns the 1-based positions extended.
CREATE OR REPLACE FUNCTION Q_extend(keys bytea[], toks text[], ttls bigint[])
RETURNS SETOF bigint LANGUAGE sql AS $$
  UPDATE Q_lock l SET expires_at = clock_timestamp() + u.ttl * interval '1 ms'
  FROM (SELECT * FROM unnest(keys, toks, ttls) WITH ORDINALITY AS x(k, t, ttl, i)
        ORDER BY x.k) u
  WHERE l.key = u.k AND l.token = u.t AND l.expires_at > clock_timestamp()
  RETURNING u.i
$$;

-- Raises a name's fence counter (never lowers it).
CREATE OR REPLACE FUNCTION Q_raise_fence(k bytea, at_least bigint)
RETURNS void LANGUAGE sql AS $$
  INSERT INTO Q_lock AS l (key, fence) VALUES (k, at_least)
  ON CONFLICT (key) DO UPDATE SET fence = greatest(l.fence, EXCLUDED.fence)
$$;

-- What is known of a name: held, ms left, fence, label.
CREATE OR REPLACE FUNCTION Q_inspect(k bytea, OUT held boolean, OUT left_ms bigint,
  OUT fence bigint, OUT label bytea)
LANGUAGE sql AS $$
  SELECT l.token IS NOT NULL AND l.expires_at > clock_timestamp(),
    CASE WHEN l.token IS NOT NULL AND l.expires_at > clock_timestamp()
      THEN greatest(0, ceil(extract(epoch FROM (l.expires_at - clock_timestamp())) * 1000))::bigint
    END,
    l.fence,
    CASE WHEN l.token IS NOT NULL AND l.expires_at > clock_timestamp() THEN l.label END
  FROM Q_lock l WHERE l.key = k
$$;

INSERT INTO Q_meta (id, version) VALUES (1, 1)
  ON CONFLICT (id) DO UPDATE SET version = greatest(Q_meta.version, EXCLUDED.version);
