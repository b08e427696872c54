//! The lock record on one server and the scripts that run on it, as `prelude.lua` and the
//! acquire, extend and release scripts write them. Times are in ticks of the server's own
//! clock (`sc`); a fencing token counts [`SCALE`] per tick (the server's clock in µs).

/// Fencing-token units per tick: the scripts floor a token at the server's clock in µs, and
/// a server runs fewer scripts than that per tick.
pub const SCALE: u32 = 1000;

/// A token: 0 none; [`READ`] and [`PERMITS`] are the shared modes' markers in `t`.
pub type Tok = u8;
/// The marker of a time of reads in the record's `t`.
pub const READ: Tok = 254;
/// The marker of a time of permits in the record's `t`.
pub const PERMITS: Tok = 255;

/// How long (ticks) a waiting plain claim holds new reads back at most (`PREFERENCE`).
pub const PREFERENCE: i16 = 2;

/// The model's knobs on the scripts (the mutants that change them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rules {
    /// `grant` floors the token at the server's clock (`clock_us`). Off: the counter alone.
    pub clock_floor: bool,
    /// `bar` writes the tombstone. Off: an abandon is a plain release.
    pub tombstone: bool,
    /// Send order: a release ends only a lease granted by an acquire sent before it, and an
    /// acquire sent before a later operation of its token is not granted. Off: numbers are
    /// ignored (the protocol before them).
    pub send_order: bool,
}

/// A lock record with the keys beside it (`<key>:abandoned`, `:writers`, `:shared`,
/// `:sharers`). The record's hour (`x`, `z`), labels (`h`) and the fair queue are left out:
/// a bounded run is far shorter than an hour, and labels carry no safety.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct Data {
    /// `t`: the holder's token, or a shared mode's marker; 0 when there is no record.
    pub t: Tok,
    /// `e`: the lease's expiry (server ticks); 0 once released.
    pub e: i16,
    /// `f`: the fencing counter.
    pub f: u32,
    /// `r`: the token whose release the last grant replaced.
    pub r: Tok,
    /// `n`: the send number of `t`'s last grant, renewal or release (0: none).
    pub n: u16,
    /// `m`: `n` as it was when `r` was released.
    pub m: u16,
    /// `w`: plain waiters' flag (releases publish while it runs).
    pub w: i16,
    /// `v`: the writer preference (new reads wait while it runs).
    pub v: i16,
    /// `s`: shared waiters' flag.
    pub s: i16,
    /// `a`: until when `abandoned` is looked at.
    pub a: i16,
    /// `<key>:abandoned`: token → until.
    pub abandoned: Vec<(Tok, i16)>,
    /// `<key>:writers`: waiting writers' preferences, token → until.
    pub writers: Vec<(Tok, i16)>,
    /// `<key>:shared`: shared holds, token → expiry (negative: released at minus that).
    pub shared: Vec<(Tok, i16)>,
    /// `<key>:sharers`: shared holds' fencing tokens and send numbers.
    pub sharers: Vec<(Tok, (u32, u16))>,
}

fn get<V: Copy>(m: &[(Tok, V)], k: Tok) -> Option<V> {
    m.iter().find(|(t, _)| *t == k).map(|(_, v)| *v)
}

fn set<V>(m: &mut Vec<(Tok, V)>, k: Tok, v: V) {
    match m.iter_mut().find(|(t, _)| *t == k) {
        Some(slot) => slot.1 = v,
        None => {
            m.push((k, v));
            m.sort_by_key(|(t, _)| *t);
        }
    }
}

fn del<V>(m: &mut Vec<(Tok, V)>, k: Tok) -> bool {
    let before = m.len();
    m.retain(|(t, _)| *t != k);
    m.len() != before
}

/// `holding`: the holder while the lease runs at `now`.
pub fn holding(t: Tok, e: i16, now: i16) -> Option<Tok> {
    (t != 0 && e > now).then_some(t)
}

/// What a script did that the model's ghost state watches.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Effects {
    /// A fencing token minted by a fresh grant (not an "ours" answer).
    pub minted: Option<u32>,
    /// The token that was freshly granted (exclusive or shared).
    pub granted: Option<Tok>,
    /// A lease ended (`end_lease`): whether it published a wake-up.
    pub ended: Option<bool>,
    /// A waiter registered (`w` set) until then.
    pub registered: Option<i16>,
}

/// A script's answer.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Answer {
    /// `{1, fence}`.
    Granted(u32),
    /// `{0, left}`: held by another, or yielded, or barred.
    Held,
    /// `{2, ms}`: up for less than the minimum uptime.
    Warming,
    /// An extension's or a release's 1 (`true`) or 0.
    Done(bool),
}

impl Data {
    /// `bar`: `token` may not be granted for `ms` from `now`.
    fn bar(&mut self, rules: Rules, token: Tok, now: i16, ms: i16) {
        if !rules.tombstone {
            return;
        }
        self.abandoned.retain(|(_, until)| *until > now);
        set(&mut self.abandoned, token, now + ms);
        self.a = self.a.max(now + ms);
    }

    /// `barred`: `a` runs and the token is in the set (whatever its own score).
    fn barred(&self, token: Tok, now: i16) -> bool {
        self.a > now && get(&self.abandoned, token).is_some()
    }

    /// `stale_acquire`: an acquire numbered `seq` of `token`, which does not hold the lease,
    /// was sent before a later operation of that token ran here.
    fn stale_acquire(&self, rules: Rules, token: Tok, seq: u16) -> bool {
        rules.send_order && ((self.t == token && self.n > seq) || (self.r == token && self.m > seq))
    }

    /// `grant`: returns the fence. `seq`: the acquire's send number (`None`: a shared mode's
    /// marker, which keeps `n`).
    fn grant(
        &mut self,
        rules: Rules,
        token: Tok,
        ttl: i16,
        floor: u32,
        now: i16,
        seq: Option<u16>,
    ) -> u32 {
        let clock_us = u32::try_from(now.max(0)).unwrap_or(0) * SCALE;
        let mut fence = (self.f + 1).max(floor.min(clock_us + 2 * SCALE));
        if rules.clock_floor {
            fence = fence.max(clock_us);
        }
        if self.e == 0 && self.t != 0 && self.t != token && self.t != READ && self.t != PERMITS {
            self.r = self.t;
            self.m = self.n;
        }
        if let Some(seq) = seq {
            self.n = seq;
        }
        self.t = token;
        self.e = now + ttl;
        self.f = fence;
        fence
    }

    /// `end_lease`: `e` = 0; publishes while `s` or `w` runs. Returns whether it published.
    fn end_lease(&mut self, now: i16) -> bool {
        self.e = 0;
        self.s > now || self.w > now
    }

    /// acquire.lua, one lease: `flag` the waiters-flag ttl (0: not waiting), `arriving` a
    /// waiting acquire's first attempt, `floor` the quorum's fence floor, `min_uptime`
    /// checked by the caller.
    #[allow(clippy::too_many_arguments)]
    pub fn acquire(
        &mut self,
        rules: Rules,
        token: Tok,
        ttl: i16,
        flag: i16,
        arriving: bool,
        floor: u32,
        now: i16,
        seq: u16,
        fx: &mut Effects,
    ) -> Answer {
        // arrive
        let holder = holding(self.t, self.e, now);
        if holder == Some(token) {
            self.e = now + ttl;
            self.n = self.n.max(seq);
            return Answer::Granted(self.f);
        }
        if self.barred(token, now) {
            return Answer::Held;
        }
        if self.stale_acquire(rules, token, seq) {
            return Answer::Held;
        }
        if holder.is_some() {
            if flag > 0 {
                let pref = now + flag.min(PREFERENCE);
                self.w = now + flag;
                self.v = self.v.max(pref);
                set(&mut self.writers, token, pref);
                fx.registered = Some(now + flag);
            }
            return Answer::Held;
        }
        if arriving && self.w > now {
            return Answer::Held;
        }
        let fence = self.grant(rules, token, ttl, floor, now, Some(seq));
        if self.v > now {
            self.v = 0;
            self.writers.clear();
        }
        fx.minted = Some(fence);
        fx.granted = Some(token);
        Answer::Granted(fence)
    }

    /// extend.lua, one lease.
    pub fn extend(&mut self, token: Tok, ttl: i16, now: i16) -> bool {
        if holding(self.t, self.e, now) != Some(token) {
            return false;
        }
        self.e = now + ttl;
        true
    }

    /// shared_extend.lua, one hold.
    pub fn shared_extend(&mut self, token: Tok, ttl: i16, now: i16) -> bool {
        if !matches!(holding(self.t, self.e, now), Some(READ | PERMITS)) {
            return false;
        }
        match get(&self.shared, token) {
            Some(score) if score > now => {}
            _ => return false,
        }
        set(&mut self.shared, token, now + ttl);
        self.e = self.e.max(now + ttl);
        true
    }

    /// `drop_dead`: shared holds that ran out (scores 0..=now; released ones are negative).
    fn drop_dead(&mut self, now: i16) {
        let dead: Vec<Tok> = self
            .shared
            .iter()
            .filter(|(_, s)| (0..=now).contains(s))
            .map(|(t, _)| *t)
            .collect();
        for t in dead {
            del(&mut self.sharers, t);
            del(&mut self.shared, t);
        }
    }

    /// shared_acquire.lua, one attempt: `permits` 0 for a read.
    #[allow(clippy::too_many_arguments)]
    pub fn shared_acquire(
        &mut self,
        rules: Rules,
        token: Tok,
        ttl: i16,
        flag: i16,
        arriving: bool,
        permits: u8,
        now: i16,
        seq: u16,
        fx: &mut Effects,
    ) -> Answer {
        let mode = if permits > 0 { PERMITS } else { READ };
        let holder = holding(self.t, self.e, now);
        if holder == Some(mode) {
            match get(&self.shared, token) {
                Some(mine) if mine > now => {
                    set(&mut self.shared, token, now + ttl);
                    self.e = self.e.max(now + ttl);
                    let (fence, had) = get(&self.sharers, token).unwrap_or((self.f, 0));
                    set(&mut self.sharers, token, (fence, had.max(seq)));
                    return Answer::Granted(fence);
                }
                Some(mine) if mine < 0 => return Answer::Held,
                _ => {}
            }
        }
        if self.barred(token, now) {
            return Answer::Held;
        }
        let wait_here = |d: &mut Data| {
            if flag > 0 {
                d.s = now + flag;
            }
        };
        if holder.is_some() && holder != Some(mode) {
            wait_here(self);
            return Answer::Held;
        }
        if mode == READ && self.v > now {
            wait_here(self);
            return Answer::Held;
        }
        if mode == PERMITS && arriving && self.s > now {
            return Answer::Held;
        }
        self.drop_dead(now);
        if mode == PERMITS && holder.is_some() {
            let live = self.shared.iter().filter(|(_, s)| *s > now).count();
            if live >= usize::from(permits) {
                wait_here(self);
                return Answer::Held;
            }
        }
        let clock_us = u32::try_from(now.max(0)).unwrap_or(0) * SCALE;
        let mut fence = self.f + 1;
        if rules.clock_floor {
            fence = fence.max(clock_us);
        }
        set(&mut self.sharers, token, (fence, seq));
        set(&mut self.shared, token, now + ttl);
        if holder.is_none() {
            self.grant(rules, mode, ttl, 0, now, None);
        } else {
            self.e = self.e.max(now + ttl);
            self.f = fence;
        }
        fx.minted = Some(fence);
        fx.granted = Some(token);
        Answer::Granted(fence)
    }

    /// release.lua, one lease: `tomb` > 0 abandons (bars the token that long).
    #[allow(clippy::too_many_arguments)]
    pub fn release(
        &mut self,
        rules: Rules,
        token: Tok,
        shared: bool,
        tomb: i16,
        now: i16,
        seq: u16,
        fx: &mut Effects,
    ) -> bool {
        if tomb > 0 {
            self.bar(rules, token, now, tomb);
        }
        if shared {
            return self.release_shared(rules, token, now, seq, fx);
        }
        if tomb > 0 {
            self.withdraw(token, now);
        }
        if self.t == token && holding(self.t, self.e, now).is_some() {
            if rules.send_order && self.n > seq {
                // A late copy of a release sent before the grant: not this lease's.
                return false;
            }
            fx.ended = Some(self.end_lease(now));
            self.n = seq;
            return true;
        }
        if rules.send_order && self.t == token && self.n < seq {
            self.n = seq;
        }
        (self.t == token && self.e == 0) || self.r == token
    }

    /// `withdraw`: a waiting writer that gave up lets new reads in.
    fn withdraw(&mut self, token: Tok, now: i16) {
        if !del(&mut self.writers, token) || self.v <= now {
            return;
        }
        self.writers.retain(|(_, until)| *until > now);
        let rest = self.writers.iter().map(|(_, u)| *u).max().unwrap_or(0);
        if rest < self.v {
            self.v = rest;
        }
    }

    /// `release_shared`.
    fn release_shared(
        &mut self,
        rules: Rules,
        token: Tok,
        now: i16,
        seq: u16,
        fx: &mut Effects,
    ) -> bool {
        let Some(score) = get(&self.shared, token) else {
            return false;
        };
        if score < 0 {
            return true;
        }
        if rules.send_order && get(&self.sharers, token).is_some_and(|(_, n)| n > seq) {
            return false;
        }
        del(&mut self.sharers, token);
        if score <= now || !matches!(holding(self.t, self.e, now), Some(READ | PERMITS)) {
            del(&mut self.shared, token);
            return false;
        }
        set(&mut self.shared, token, -now);
        self.drop_dead(now);
        let latest = self
            .shared
            .iter()
            .map(|(_, s)| *s)
            .filter(|s| *s > now)
            .max();
        match latest {
            None => fx.ended = Some(self.end_lease(now)),
            Some(l) => {
                if l < self.e {
                    self.e = l;
                }
            }
        }
        true
    }

    /// fence.lua: raises the counter (Redlock's write-back).
    pub fn raise_fence(&mut self, fence: u32) {
        self.f = self.f.max(fence);
    }
}
