-- The PostgreSQL store's schema: tables and functions, created on first use (see schema.rs).
-- `Q_` stands for the schema-qualified table prefix (`"public".redlease_` by default), `P_`
-- for the bare prefix and `C_` for the notification channel, all filled in by the backend.
-- Every time is the server's clock (`clock_timestamp()`, which moves within a statement),
-- never a client's. Every operation is one function call: one round trip, one short
-- transaction that locks the name's row in `lock` first (so operations on one name run one
-- after another; different names never wait for each other).

CREATE TABLE IF NOT EXISTS Q_meta (
  id int PRIMARY KEY,
  version int NOT NULL
);

-- One row per lock name, never deleted: the fencing counter outlives every lease.
CREATE TABLE IF NOT EXISTS Q_lock (
  key bytea PRIMARY KEY,   -- the lease key's bytes (a name may hold any character, NUL too)
  token text,              -- the token of the last grant (a reentrant reign's first hold;
                           -- while shared holds run, their mode's marker `*r` or `*p`);
                           -- NULL once released
  expires_at timestamptz,  -- the lease is held while this is ahead of the server's clock
  n bigint NOT NULL DEFAULT 0,          -- send number: the acquire that granted or renewed
                                        -- `token`'s lease, or the release that ended it
  fence bigint NOT NULL DEFAULT 0,      -- the last fencing token: never goes backwards
  label bytea,                          -- the holder's public label (UTF-8)
  released text,                        -- the token (or hold) whose release ended the last lease
  released_n bigint NOT NULL DEFAULT 0, -- that release's send number
  waiters_until timestamptz,            -- until when waiters want a notification
  owner text,                           -- the reentrant reign's owner (NULL: not reentrant)
  queued_until timestamptz,             -- until when the fair queue may hold waiters
  writers_until timestamptz,            -- until when new reads wait behind a waiting writer
  sharers_until timestamptz             -- until when shared claims wait (a release wakes all)
);

-- Abandoned attempts: a late copy of one (a statement still running on the server after its
-- connection dropped) is never granted.
CREATE TABLE IF NOT EXISTS Q_barred (
  token text PRIMARY KEY,
  key bytea NOT NULL,
  until timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS P_barred_until ON Q_barred (until);

-- Fair waiters, in arrival order; a waiter that does not come back by `until` is dropped.
CREATE TABLE IF NOT EXISTS Q_queue (
  key bytea NOT NULL,
  token text NOT NULL,
  seq bigint GENERATED ALWAYS AS IDENTITY,
  until timestamptz NOT NULL,
  PRIMARY KEY (key, token)
);
CREATE INDEX IF NOT EXISTS P_queue_order ON Q_queue (key, seq);

-- The live holds of a reentrant reign (the lock row's `owner`): the count is their number.
CREATE TABLE IF NOT EXISTS Q_hold (
  key bytea NOT NULL,
  token text NOT NULL,
  PRIMARY KEY (key, token)
);

-- Shared holds (reads, permits) while the lock row holds their mode's marker; a released
-- one stays with `expires_at = -infinity` (a re-sent release still says "ours") until the
-- mode is granted afresh.
CREATE TABLE IF NOT EXISTS Q_shared (
  key bytea NOT NULL,
  token text NOT NULL,
  expires_at timestamptz NOT NULL,
  fence bigint NOT NULL,
  label bytea,
  PRIMARY KEY (key, token)
);

-- Waiting plain claims (writers): new reads wait behind the latest until it lapses.
CREATE TABLE IF NOT EXISTS Q_writer (
  key bytea NOT NULL,
  token text NOT NULL,
  until timestamptz NOT NULL,
  PRIMARY KEY (key, token)
);

-- The name's row, locked for the rest of the transaction (made if missing).
CREATE OR REPLACE FUNCTION Q_row(k bytea) RETURNS Q_lock
LANGUAGE plpgsql AS $$
DECLARE
  r Q_lock%ROWTYPE;
BEGIN
  SELECT * INTO r FROM Q_lock WHERE key = k FOR UPDATE;
  IF NOT FOUND THEN
    INSERT INTO Q_lock (key) VALUES (k) ON CONFLICT (key) DO NOTHING;
    SELECT * INTO r FROM Q_lock WHERE key = k FOR UPDATE;
  END IF;
  RETURN r;
END $$;

-- Milliseconds from `now_` to `t`, at least 1.
CREATE OR REPLACE FUNCTION Q_ms(t timestamptz, now_ timestamptz) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
  SELECT greatest(1, ceil(extract(epoch FROM (t - now_)) * 1000))::bigint
$$;

-- A notification (delivered at commit). `what`: `1` one local waiter of the key, `a` every
-- one; the key in hex (a payload is text under 8000 bytes; `*`, every waiter of every key,
-- for a key too long for it).
CREATE OR REPLACE FUNCTION Q_notify(k bytea, what text) RETURNS void
LANGUAGE sql AS $$
  SELECT pg_notify('C_', CASE WHEN length(k) <= 3000 THEN what || ':' || encode(k, 'hex')
    ELSE '*' END)
$$;

-- Hands a free name to its fair queue: drops dead waiters and wakes the head, only it.
CREATE OR REPLACE FUNCTION Q_wake_head(k bytea, r Q_lock, now_ timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
  head text;
BEGIN
  IF r.queued_until > now_ THEN
    DELETE FROM Q_queue WHERE key = k AND until <= now_;
    SELECT token INTO head FROM Q_queue WHERE key = k ORDER BY seq LIMIT 1;
    IF head IS NOT NULL THEN
      PERFORM pg_notify('C_', 't:' || head);
    END IF;
  END IF;
END $$;

-- A release freed the name: wakes one local waiter per process (every one while shared
-- claims wait), and the fair queue's head.
CREATE OR REPLACE FUNCTION Q_wake(k bytea, r Q_lock, now_ timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  IF r.sharers_until > now_ THEN
    PERFORM Q_notify(k, 'a');
  ELSIF r.waiters_until > now_ THEN
    PERFORM Q_notify(k, '1');
  END IF;
  PERFORM Q_wake_head(k, r, now_);
END $$;

-- Grants the name to `tok` (a reentrant reign's first hold, with `owner_`), minting the next
-- fence: at least the last + 1, at least the server's clock in µs (so a database made
-- again still hands out larger ones), and at least `floor_` (capped at the clock + 2 s).
CREATE OR REPLACE FUNCTION Q_grant(k bytea, r Q_lock, tok text, ttl_ms bigint,
  floor_ bigint, lbl bytea, sn bigint, owner_ text, plain boolean, now_ timestamptz)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
  clock_us bigint := floor(extract(epoch FROM now_) * 1000000)::bigint;
  f bigint := greatest(r.fence + 1, clock_us, least(floor_, clock_us + 2000000));
BEGIN
  IF r.owner IS NOT NULL THEN
    DELETE FROM Q_hold WHERE key = k;
  END IF;
  IF plain AND r.writers_until IS NOT NULL THEN
    -- The writer that new reads waited behind has the lock.
    DELETE FROM Q_writer WHERE key = k;
    r.writers_until := NULL;
  END IF;
  UPDATE Q_lock SET token = tok, expires_at = now_ + ttl_ms * interval '1 ms', n = sn,
    fence = f, label = lbl, owner = owner_, writers_until = r.writers_until
    WHERE key = k;
  RETURN f;
END $$;

-- One acquire attempt of any kind: `kind` is `p` (plain), `f` (fair), `r` (reentrant, by
-- `owner_`) or `s` (shared: a read when `permits` is 0, else one of `permits` permits).
-- `wait_ms`: how long a waiter stays registered (0: not waiting); `arriving`: a waiting
-- acquire's first attempt, which yields to registered waiters. Returns `code` 1 granted
-- (`val` the fence, `lease` the lease's token, `holds` a reentrant reign's count), 0 not
-- granted (`val` ms until a re-check is worth it, or -1 when unknown).
CREATE OR REPLACE FUNCTION Q_acquire(
  k bytea, tok text, kind text, owner_ text, permits int, ttl_ms bigint, wait_ms bigint,
  arriving boolean, floor_ bigint, lbl bytea, sn bigint,
  OUT code int, OUT val bigint, OUT lease text, OUT holds int)
LANGUAGE plpgsql AS $$
DECLARE
  r Q_lock%ROWTYPE := Q_row(k);
  now_ timestamptz := clock_timestamp();
  held boolean;
  left_ bigint;
  head text;
  head_until timestamptz;
  mode text;
  lapse timestamptz;
  f bigint;
BEGIN
  held := r.token IS NOT NULL AND r.expires_at > now_;
  left_ := CASE WHEN held THEN Q_ms(r.expires_at, now_) ELSE -1 END;
  code := 0; val := left_; lease := tok;
  IF kind IN ('p', 'f') AND held AND r.token = tok THEN
    -- Ours already: a repeated attempt. Renewed, same fence.
    UPDATE Q_lock SET expires_at = greatest(expires_at, now_ + ttl_ms * interval '1 ms'),
      n = greatest(n, sn) WHERE key = k;
    code := 1; val := r.fence; RETURN;
  END IF;
  IF EXISTS (SELECT 1 FROM Q_barred b WHERE b.token = tok AND b.until > now_) THEN
    RETURN;
  END IF;
  IF kind IN ('p', 'f') AND ((r.token = tok AND r.n > sn)
      OR (r.released = tok AND r.released_n > sn)) THEN
    -- A late copy, sent before a later operation of the same token.
    val := -1; RETURN;
  END IF;

  IF kind = 'p' THEN
    IF held THEN
      IF wait_ms > 0 THEN
        -- Releases notify while waiters are registered; new reads wait behind this writer
        -- (a short lease of its own that its next attempts renew).
        INSERT INTO Q_writer (key, token, until)
          VALUES (k, tok, now_ + least(wait_ms, 2100) * interval '1 ms')
          ON CONFLICT (key, token) DO UPDATE SET until = EXCLUDED.until;
        UPDATE Q_lock SET
          waiters_until = greatest(coalesce(waiters_until, now_), now_ + wait_ms * interval '1 ms'),
          writers_until = greatest(coalesce(writers_until, now_),
            now_ + least(wait_ms, 2100) * interval '1 ms')
          WHERE key = k;
      END IF;
      RETURN;
    END IF;
    IF arriving AND r.waiters_until > now_ THEN
      -- Registered waiters go first; the flag is not refreshed on a newcomer's account.
      val := -1; RETURN;
    END IF;
    val := Q_grant(k, r, tok, ttl_ms, floor_, lbl, sn, NULL, true, now_);
    code := 1; RETURN;
  END IF;

  IF kind = 'f' THEN
    IF r.queued_until > now_ THEN
      DELETE FROM Q_queue WHERE key = k AND until <= now_;
      SELECT q.token, q.until INTO head, head_until FROM Q_queue q WHERE q.key = k
        ORDER BY q.seq LIMIT 1;
    END IF;
    IF NOT held AND (head IS NULL OR head = tok) THEN
      IF head IS NOT NULL THEN
        DELETE FROM Q_queue WHERE key = k AND token = tok;
      END IF;
      val := Q_grant(k, r, tok, ttl_ms, floor_, lbl, sn, NULL, false, now_);
      code := 1; RETURN;
    END IF;
    IF wait_ms > 0 THEN
      INSERT INTO Q_queue (key, token, until) VALUES (k, tok, now_ + wait_ms * interval '1 ms')
        ON CONFLICT (key, token) DO UPDATE SET until = EXCLUDED.until;
      UPDATE Q_lock SET
        queued_until = greatest(coalesce(queued_until, now_), now_ + wait_ms * interval '1 ms')
        WHERE key = k;
      IF head IS NULL THEN
        head := tok;
      END IF;
    END IF;
    IF NOT held AND head IS NOT NULL AND head <> tok THEN
      -- Free, and another waiter is at the head: wake it (its wake-up may have been lost),
      -- and come back by its deadline at the latest.
      PERFORM pg_notify('C_', 't:' || head);
      val := Q_ms(head_until, now_);
    END IF;
    RETURN;
  END IF;

  IF kind = 'r' THEN
    IF held AND r.owner = owner_ THEN
      -- One more hold of the reign's owner; never shortened by a shorter TTL.
      INSERT INTO Q_hold (key, token) VALUES (k, tok) ON CONFLICT DO NOTHING;
      SELECT count(*) INTO holds FROM Q_hold WHERE key = k;
      UPDATE Q_lock SET expires_at = greatest(expires_at, now_ + ttl_ms * interval '1 ms')
        WHERE key = k;
      code := 1; val := r.fence; lease := r.token; RETURN;
    END IF;
    IF held THEN
      IF wait_ms > 0 THEN
        UPDATE Q_lock SET waiters_until = greatest(coalesce(waiters_until, now_),
          now_ + wait_ms * interval '1 ms') WHERE key = k;
      END IF;
      RETURN;
    END IF;
    IF arriving AND r.waiters_until > now_ THEN
      val := -1; RETURN;
    END IF;
    val := Q_grant(k, r, tok, ttl_ms, floor_, lbl, sn, owner_, false, now_);
    INSERT INTO Q_hold (key, token) VALUES (k, tok);
    code := 1; holds := 1; RETURN;
  END IF;

  -- Shared: a read or a permit, each its own lease.
  mode := CASE WHEN permits > 0 THEN '*p' ELSE '*r' END;
  IF held AND r.token = mode THEN
    SELECT s.fence INTO f FROM Q_shared s
      WHERE s.key = k AND s.token = tok AND s.expires_at > now_;
    IF FOUND THEN
      -- Ours already: a repeated attempt.
      UPDATE Q_shared SET expires_at = now_ + ttl_ms * interval '1 ms'
        WHERE key = k AND token = tok;
      UPDATE Q_lock SET expires_at = greatest(expires_at, now_ + ttl_ms * interval '1 ms')
        WHERE key = k;
      code := 1; val := f; RETURN;
    END IF;
  END IF;
  IF permits = 0 AND r.writers_until > now_ THEN
    -- A read waits behind a waiting writer, until its preference lapses at the latest.
    lapse := r.writers_until;
  END IF;
  IF (held AND r.token <> mode) OR lapse IS NOT NULL
     OR (permits > 0 AND held AND (SELECT count(*) FROM Q_shared s
           WHERE s.key = k AND s.expires_at > now_) >= permits) THEN
    IF wait_ms > 0 THEN
      UPDATE Q_lock SET sharers_until = greatest(coalesce(sharers_until, now_),
        now_ + wait_ms * interval '1 ms') WHERE key = k;
    END IF;
    IF lapse IS NOT NULL THEN
      -- Back when the writer's preference lapses, at the latest.
      val := CASE WHEN held THEN least(left_, Q_ms(lapse, now_)) ELSE Q_ms(lapse, now_) END;
    ELSIF permits > 0 AND held AND r.token = mode THEN
      -- Every permit taken: the first to run out frees one.
      SELECT Q_ms(min(s.expires_at), now_) INTO val FROM Q_shared s
        WHERE s.key = k AND s.expires_at > now_;
    END IF;
    RETURN;
  END IF;
  IF permits > 0 AND arriving AND r.waiters_until > now_ THEN
    RETURN;
  END IF;
  IF held THEN
    f := greatest(r.fence + 1, floor(extract(epoch FROM now_) * 1000000)::bigint);
    UPDATE Q_lock SET fence = f,
      expires_at = greatest(expires_at, now_ + ttl_ms * interval '1 ms') WHERE key = k;
  ELSE
    DELETE FROM Q_shared WHERE key = k;
    f := Q_grant(k, r, mode, ttl_ms, 0, NULL, 0, NULL, false, now_);
  END IF;
  INSERT INTO Q_shared (key, token, expires_at, fence, label)
    VALUES (k, tok, now_ + ttl_ms * interval '1 ms', f, lbl)
    ON CONFLICT (key, token) DO UPDATE SET expires_at = EXCLUDED.expires_at,
      fence = EXCLUDED.fence, label = EXCLUDED.label;
  code := 1; val := f;
END $$;

-- Gives a claim back (kinds as for acquire; `abandon`: its outcome was never learnt, so the
-- token is barred too, leaves the fair queue and withdraws its writer preference). Returns
-- the holds left (0: the lease is gone; a reentrant reign's count otherwise) when the claim
-- held it (also for a re-sent release), -1 when it did not.
CREATE OR REPLACE FUNCTION Q_release(k bytea, tok text, kind text, owner_ text,
  lease text, sn bigint, abandon boolean)
RETURNS int LANGUAGE plpgsql AS $$
DECLARE
  r Q_lock%ROWTYPE;
  now_ timestamptz := clock_timestamp();
  held boolean;
  cnt int;
  latest timestamptz;
  was_head boolean;
  before timestamptz;
BEGIN
  IF abandon THEN
    r := Q_row(k);
    INSERT INTO Q_barred (token, key, until) VALUES (tok, k, now_ + interval '300 s')
      ON CONFLICT (token) DO UPDATE SET until = EXCLUDED.until;
    IF random() < 0.01 THEN
      DELETE FROM Q_barred WHERE until < now_;
    END IF;
  ELSE
    SELECT * INTO r FROM Q_lock WHERE key = k FOR UPDATE;
    IF NOT FOUND THEN
      RETURN -1;
    END IF;
  END IF;
  held := r.token IS NOT NULL AND r.expires_at > now_;

  IF kind = 'r' THEN
    IF held AND r.owner = owner_ THEN
      DELETE FROM Q_hold WHERE key = k AND token = tok;
      IF FOUND THEN
        SELECT count(*) INTO cnt FROM Q_hold WHERE key = k;
        IF cnt = 0 THEN
          UPDATE Q_lock SET token = NULL, expires_at = NULL, label = NULL, owner = NULL,
            released = tok, released_n = sn, n = sn WHERE key = k;
          PERFORM Q_wake(k, r, now_);
        END IF;
        RETURN cnt;
      END IF;
      IF lease = r.token THEN
        -- Counted in this reign and gone already: a repeated release.
        RETURN (SELECT count(*) FROM Q_hold WHERE key = k);
      END IF;
      RETURN -1;
    END IF;
    IF NOT held AND r.released = tok AND NOT abandon THEN
      RETURN 0;
    END IF;
    RETURN -1;
  END IF;

  IF kind = 's' THEN
    IF held AND r.token IN ('*r', '*p') THEN
      UPDATE Q_shared SET expires_at = '-infinity'
        WHERE key = k AND token = tok AND expires_at > now_;
      IF FOUND THEN
        SELECT max(expires_at) INTO latest FROM Q_shared WHERE key = k AND expires_at > now_;
        IF latest IS NULL THEN
          UPDATE Q_lock SET token = NULL, expires_at = NULL, label = NULL, n = sn
            WHERE key = k;
          PERFORM Q_wake(k, r, now_);
        ELSE
          UPDATE Q_lock SET expires_at = latest WHERE key = k;
          IF r.token = '*p' AND (r.waiters_until > now_ OR r.sharers_until > now_) THEN
            PERFORM Q_notify(k, '1');
          END IF;
        END IF;
        RETURN 0;
      END IF;
    END IF;
    IF NOT abandon AND EXISTS (SELECT 1 FROM Q_shared
        WHERE key = k AND token = tok AND expires_at = '-infinity') THEN
      RETURN 0;
    END IF;
    RETURN -1;
  END IF;

  -- Plain and fair.
  IF held AND r.token = tok AND (abandon OR r.n < sn) THEN
    UPDATE Q_lock SET token = NULL, expires_at = NULL, label = NULL, released = tok,
      released_n = sn, n = sn WHERE key = k;
    PERFORM Q_wake(k, r, now_);
    RETURN 0;
  END IF;
  IF abandon THEN
    IF r.queued_until > now_ THEN
      was_head := (SELECT q.token FROM Q_queue q WHERE q.key = k AND q.until > now_
        ORDER BY q.seq LIMIT 1) = tok;
      DELETE FROM Q_queue WHERE key = k AND token = tok;
      IF FOUND AND was_head AND NOT held THEN
        PERFORM Q_wake_head(k, r, now_);
      END IF;
    END IF;
    IF r.writers_until > now_ THEN
      before := r.writers_until;
      DELETE FROM Q_writer WHERE key = k AND token = tok;
      IF FOUND THEN
        SELECT max(until) INTO latest FROM Q_writer WHERE key = k AND until > now_;
        UPDATE Q_lock SET writers_until = latest WHERE key = k;
        -- Reads held back by it may go in sooner: wake them (no write holds the name).
        IF (latest IS NULL OR latest < before) AND r.sharers_until > now_
           AND NOT (held AND r.token <> '*r') THEN
          PERFORM Q_notify(k, 'a');
        END IF;
      END IF;
    END IF;
  END IF;
  IF NOT abandon AND r.released = tok THEN
    RETURN 0;
  END IF;
  RETURN -1;
END $$;

-- Extends many leases in one call: returns the 1-based positions extended. Plain, fair and
-- reentrant leases are the name's row; shared holds (tokens starting with `s`) their own
-- row, and the name's lease runs as long as its latest hold.
CREATE OR REPLACE FUNCTION Q_extend(keys bytea[], toks text[], ttls bigint[])
RETURNS SETOF bigint LANGUAGE plpgsql AS $$
BEGIN
  -- The names' rows, locked in key order first: two processes extending overlapping names
  -- (reads of the same locks) never wait for each other in a cycle.
  PERFORM 1 FROM Q_lock WHERE key = ANY (keys) ORDER BY key FOR UPDATE;
  RETURN QUERY
  UPDATE Q_lock l SET expires_at = clock_timestamp() + u.ttl * interval '1 ms'
  FROM (SELECT * FROM unnest(keys, toks, ttls) WITH ORDINALITY AS x(k, t, ttl, i)
        WHERE left(x.t, 1) <> 's') u
  WHERE l.key = u.k AND l.token = u.t AND l.expires_at > clock_timestamp()
  RETURNING u.i;
  IF EXISTS (SELECT 1 FROM unnest(toks) t WHERE left(t, 1) = 's') THEN
    RETURN QUERY
    WITH s AS (
      UPDATE Q_shared sh SET expires_at = clock_timestamp() + u.ttl * interval '1 ms'
      FROM (SELECT * FROM unnest(keys, toks, ttls) WITH ORDINALITY AS x(k, t, ttl, i)
            WHERE left(x.t, 1) = 's') u, Q_lock l
      WHERE sh.key = u.k AND sh.token = u.t AND sh.expires_at > clock_timestamp()
        AND l.key = u.k AND l.token IN ('*r', '*p') AND l.expires_at > clock_timestamp()
      RETURNING sh.key, sh.expires_at, u.i
    ), m AS (
      UPDATE Q_lock l SET expires_at = greatest(l.expires_at, e.latest)
      FROM (SELECT s.key, max(s.expires_at) AS latest FROM s GROUP BY s.key) e
      WHERE l.key = e.key
    )
    SELECT s.i FROM s;
  END IF;
END $$;

-- Raises a name's fence counter (never lowers it).
CREATE OR REPLACE FUNCTION Q_raise_fence(k bytea, at_least bigint)
RETURNS void LANGUAGE sql AS $$
  INSERT INTO Q_lock AS l (key, fence) VALUES (k, at_least)
  ON CONFLICT (key) DO UPDATE SET fence = greatest(l.fence, EXCLUDED.fence)
$$;

-- What is known of a name, read in one statement.
CREATE OR REPLACE FUNCTION Q_inspect(k bytea, OUT held boolean, OUT left_ms bigint,
  OUT fence bigint, OUT label bytea, OUT reentrant bigint, OUT shared bigint,
  OUT shared_labels bytea[], OUT queued bigint)
LANGUAGE plpgsql AS $$
DECLARE
  r Q_lock%ROWTYPE;
  now_ timestamptz := clock_timestamp();
BEGIN
  SELECT * INTO r FROM Q_lock l WHERE l.key = k;
  IF NOT FOUND THEN
    RETURN;
  END IF;
  held := r.token IS NOT NULL AND r.expires_at > now_;
  fence := r.fence;
  queued := 0;
  IF held THEN
    left_ms := greatest(0, ceil(extract(epoch FROM (r.expires_at - now_)) * 1000))::bigint;
    IF r.token IN ('*r', '*p') THEN
      SELECT count(*), array_agg(s.label) FILTER (WHERE s.label IS NOT NULL)
        INTO shared, shared_labels
        FROM Q_shared s WHERE s.key = k AND s.expires_at > now_;
    ELSE
      label := r.label;
      IF r.owner IS NOT NULL THEN
        SELECT count(*) INTO reentrant FROM Q_hold h WHERE h.key = k;
      END IF;
    END IF;
  END IF;
  IF r.queued_until > now_ THEN
    SELECT count(*) INTO queued FROM Q_queue q WHERE q.key = k AND q.until > now_;
  END IF;
END $$;

-- The stampede cache: one value per name beside its compute lease (the name's `lock` row),
-- written only while the writer's token holds that lease; failed compute rounds, each kept
-- a short while; the refresh cooldown.
CREATE TABLE IF NOT EXISTS Q_value (
  key bytea PRIMARY KEY,
  payload bytea NOT NULL,
  delta_us bigint NOT NULL,     -- how long the compute took
  grace_ms bigint NOT NULL,     -- the stale-while-revalidate window it was written with
  round bigint NOT NULL,        -- the compute round (fence) that wrote it
  expires_at timestamptz NOT NULL,  -- grace included
  cooldown_until timestamptz    -- no background refresh before this
);

CREATE TABLE IF NOT EXISTS Q_failed (
  key bytea NOT NULL,
  round bigint NOT NULL,
  message text NOT NULL,
  until timestamptz NOT NULL,
  PRIMARY KEY (key, round)
);

-- Everything a caller decides on, in one statement: the value (if live), the compute lease's
-- round and time left (-2 when free), whether the awaited round failed and why, the cooldown.
CREATE OR REPLACE FUNCTION Q_cache_read(k bytea, awaited bigint,
  OUT has boolean, OUT payload bytea, OUT delta_us bigint, OUT grace_ms bigint,
  OUT pttl bigint, OUT round bigint, OUT lease_pttl bigint, OUT failed boolean,
  OUT message text, OUT by_round bigint, OUT cooling boolean)
LANGUAGE plpgsql AS $$
DECLARE
  now_ timestamptz := clock_timestamp();
  v Q_value%ROWTYPE;
  r Q_lock%ROWTYPE;
BEGIN
  SELECT * INTO v FROM Q_value x WHERE x.key = k;
  has := FOUND AND v.expires_at > now_;
  IF has THEN
    payload := v.payload; delta_us := v.delta_us; grace_ms := v.grace_ms;
    pttl := greatest(0, floor(extract(epoch FROM (v.expires_at - now_)) * 1000))::bigint;
    by_round := v.round;
  END IF;
  cooling := v.cooldown_until > now_;
  cooling := coalesce(cooling, false);
  SELECT * INTO r FROM Q_lock l WHERE l.key = k;
  lease_pttl := -2; round := 0;
  IF r.token IS NOT NULL AND r.expires_at > now_ THEN
    lease_pttl := greatest(0, floor(extract(epoch FROM (r.expires_at - now_)) * 1000))::bigint;
    round := r.fence;
  END IF;
  failed := false;
  IF awaited > 0 THEN
    SELECT f.message INTO message FROM Q_failed f
      WHERE f.key = k AND f.round = awaited AND f.until > now_;
    failed := FOUND;
  END IF;
END $$;

-- Writes a computed value if `tok` holds the compute lease, and wakes the waiters.
CREATE OR REPLACE FUNCTION Q_cache_fill(k bytea, tok text, payload_ bytea, delta bigint,
  grace bigint, lifetime_ms bigint, round_ bigint)
RETURNS int LANGUAGE plpgsql AS $$
DECLARE
  now_ timestamptz := clock_timestamp();
  r Q_lock%ROWTYPE;
BEGIN
  SELECT * INTO r FROM Q_lock WHERE key = k FOR UPDATE;
  IF NOT FOUND OR r.token IS DISTINCT FROM tok OR NOT r.expires_at > now_ THEN
    RETURN 0;
  END IF;
  INSERT INTO Q_value (key, payload, delta_us, grace_ms, round, expires_at)
    VALUES (k, payload_, delta, grace, round_, now_ + lifetime_ms * interval '1 ms')
    ON CONFLICT (key) DO UPDATE SET payload = EXCLUDED.payload, delta_us = EXCLUDED.delta_us,
      grace_ms = EXCLUDED.grace_ms, round = EXCLUDED.round, expires_at = EXCLUDED.expires_at,
      cooldown_until = NULL;
  IF random() < 0.01 THEN
    -- Values of names nobody asks for any more.
    DELETE FROM Q_value WHERE expires_at < now_ - interval '1 hour';
  END IF;
  PERFORM Q_notify(k, 'v');
  RETURN 1;
END $$;

-- Records that round `round_` failed (kept `keep_ms`) if `tok` holds the compute lease, sets
-- the refresh cooldown if asked (`cooldown_ms` > 0), and wakes the waiters.
CREATE OR REPLACE FUNCTION Q_cache_fail(k bytea, tok text, message_ text, keep_ms bigint,
  cooldown_ms bigint, round_ bigint)
RETURNS int LANGUAGE plpgsql AS $$
DECLARE
  now_ timestamptz := clock_timestamp();
  r Q_lock%ROWTYPE;
BEGIN
  SELECT * INTO r FROM Q_lock WHERE key = k FOR UPDATE;
  IF NOT FOUND OR r.token IS DISTINCT FROM tok OR NOT r.expires_at > now_ THEN
    RETURN 0;
  END IF;
  DELETE FROM Q_failed WHERE key = k AND until <= now_;
  INSERT INTO Q_failed (key, round, message, until)
    VALUES (k, round_, message_, now_ + keep_ms * interval '1 ms')
    ON CONFLICT (key, round) DO UPDATE SET message = EXCLUDED.message, until = EXCLUDED.until;
  IF cooldown_ms > 0 THEN
    UPDATE Q_value SET cooldown_until = now_ + cooldown_ms * interval '1 ms' WHERE key = k;
  END IF;
  PERFORM Q_notify(k, 'v');
  RETURN 1;
END $$;

INSERT INTO Q_meta (id, version) VALUES (1, 1)
  ON CONFLICT (id) DO UPDATE SET version = greatest(Q_meta.version, EXCLUDED.version);
