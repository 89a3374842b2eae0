-- The shared queue's every decision, as one atomic script on Redis's clock (see store.py for the
-- policy, the keys and the limits). KEYS[1] is the cluster's meta key "cv:{cluster}:meta"; every
-- other key shares its prefix, so its hash tag puts a cluster's keys in one Redis Cluster slot.
-- ARGV: command, replica, lease_s, then the command's own arguments.
-- Numbers are written with %.17g: Lua's default conversion keeps 14 digits, too few for seconds
-- since 1970 to the microsecond.

local P = string.sub(KEYS[1], 1, -5) -- the prefix: the key without "meta"
local cmd, me, lease_s = ARGV[1], ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local SCAN = 256 -- entries of one tenant's band (or overdue set) looked at for a servable one

local function f(x) return string.format('%.17g', x) end
local function num(x, default) if x then return tonumber(x) end return default end

local function load(id)
  local flat = redis.call('HGETALL', P .. 'e:' .. id)
  if #flat == 0 then return nil end
  local e = { id = id }
  for i = 1, #flat, 2 do e[flat[i]] = flat[i + 1] end
  return e
end

local function id_of(member) return string.sub(member, 18) end -- after "%016d:"

local function live(r) return redis.call('ZSCORE', P .. 'rep', r) end

local function push(r, msg)
  -- A dropped replica's list is not refilled: it learns from renew instead.
  if live(r) then redis.call('RPUSH', P .. 'm:' .. r, msg) end
end

local function retire(tn)
  redis.call('HDEL', P .. 'ten', tn)
  redis.call('HDEL', P .. 'tw', tn)
  redis.call('HDEL', P .. 'tf', tn)
  redis.call('HDEL', P .. 'twt', tn)
end

local function forget(id, e)
  redis.call('DEL', P .. 'e:' .. id)
  if e.sk and e.sk ~= '' and redis.call('HGET', P .. 'sk', e.sk) == id then
    redis.call('HDEL', P .. 'sk', e.sk)
  end
end

-- Take a waiting entry out of every order it is in (its tenant retires if nothing else is left).
local function unqueue(id, e)
  local tn, m = e.t, e.m
  local qk = P .. 'q:' .. tn .. ':' .. e.p
  redis.call('ZREM', qk, m)
  if redis.call('ZCARD', qk) == 0 then redis.call('ZREM', P .. 'bands:' .. tn, e.p) end
  redis.call('ZREM', P .. 'due:' .. tn, m)
  redis.call('ZREM', P .. 'over:' .. tn, m)
  redis.call('SREM', P .. 'rw:' .. e.r, id)
  local left = redis.call('HINCRBY', P .. 'tw', tn, -1)
  if left <= 0 then
    redis.call('HDEL', P .. 'tw', tn)
    redis.call('SREM', P .. 'act', tn)
    if num(redis.call('HGET', P .. 'tf', tn), 0) <= 0 then retire(tn) end
  end
end

-- A granted entry leaves its slot: charge the measured seconds (if any) instead of the predicted.
local function finish(id, e, service_s)
  if e.b and e.b ~= '' then
    if redis.call('HGET', P .. 'lid:' .. e.b, e.s) == id then
      redis.call('ZREM', P .. 'lease:' .. e.b, e.s)
      redis.call('HDEL', P .. 'lid:' .. e.b, e.s)
    end
  end
  redis.call('SREM', P .. 'rr:' .. e.r, id)
  if e.adopted ~= '1' then
    local tn = e.t
    local flying = redis.call('HINCRBY', P .. 'tf', tn, -1)
    local tag = redis.call('HGET', P .. 'ten', tn)
    if service_s and tag then
      local w = num(redis.call('HGET', P .. 'twt', tn), 1)
      redis.call('HSET', P .. 'ten', tn, f(tonumber(tag) + (service_s - tonumber(e.pr)) / w))
    end
    if flying <= 0 and num(redis.call('HGET', P .. 'tw', tn), 0) <= 0 then retire(tn) end
  end
  forget(id, e)
end

-- The empty-restart rule: no meta key means the store lost its state (or never had one). The
-- first call re-creates it and nothing is granted for a while, so every replica can re-register
-- the leases it holds first: one lease period when the caller knew the old state (its epoch), a
-- few heartbeats (FRESH_QUIET_S) when it is a replica's first join, which knew none: a new cluster
-- then starts at once, and a live replica that held leases in a store that lost them renews
-- within a heartbeat (every second).
local FRESH_QUIET_S = 3
local meta = KEYS[1]
local function ensure_meta()
  local epoch = redis.call('HGET', meta, 'epoch')
  if not epoch then
    epoch = t[1] .. '.' .. t[2]
    local quiet_s = lease_s
    if cmd == 'join' and ARGV[6 + 3 * tonumber(ARGV[4])] == 'fresh' then quiet_s = math.min(lease_s, FRESH_QUIET_S) end
    redis.call('HSET', meta, 'epoch', epoch, 'quiet_until', f(now + quiet_s), 'vt', '0')
  end
  return epoch
end

-- A replica's waiting entries leave the queue.
local function drop_waiting(r)
  for _, id in ipairs(redis.call('SMEMBERS', P .. 'rw:' .. r)) do
    local e = load(id)
    if e and e.st == 'w' then
      unqueue(id, e)
      forget(id, e)
    end
  end
  redis.call('DEL', P .. 'rw:' .. r)
end

-- A replica leaves (or stopped beating): its waiting entries leave the queue, its messages go.
-- Its leases stay until they expire (an answer may still run on them).
local function drop_replica(r)
  drop_waiting(r)
  redis.call('DEL', P .. 'm:' .. r, P .. 'mp:' .. r)
  redis.call('ZREM', P .. 'rep', r)
end

-- Leases not renewed come back; replicas that stopped beating lose their waiting entries.
local function tick()
  for _, b in ipairs(redis.call('HKEYS', P .. 'bk')) do
    local expired = redis.call('ZRANGEBYSCORE', P .. 'lease:' .. b, '-inf', '(' .. f(now))
    for _, s in ipairs(expired) do
      local id = redis.call('HGET', P .. 'lid:' .. b, s)
      redis.call('ZREM', P .. 'lease:' .. b, s)
      redis.call('HDEL', P .. 'lid:' .. b, s)
      if id then
        local e = load(id)
        if e then
          push(e.r, 'lease_lost ' .. id)
          e.b = '' -- its lease is gone already
          finish(id, e, nil)
        end
      end
    end
  end
  local dead = redis.call('ZRANGEBYSCORE', P .. 'rep', '-inf', '(' .. f(now - lease_s))
  for _, r in ipairs(dead) do drop_replica(r) end
end

-- Backends with a free slot (slots minus leases), by name.
local function free_backends()
  local all = redis.call('HGETALL', P .. 'bk')
  local out = {}
  for i = 1, #all, 2 do
    local name, slots = all[i], tonumber(all[i + 1])
    if slots - redis.call('ZCARD', P .. 'lease:' .. name) > 0 then
      local listed = redis.call('HGET', P .. 'bm', name) or ''
      local models = nil
      if listed ~= '' then
        models = {}
        for m in string.gmatch(listed, '[^\n]+') do models[m] = true end
      end
      table.insert(out, { name = name, models = models })
    end
  end
  table.sort(out, function(a, b) return a.name < b.name end)
  return out
end

local function serves(b, model) return model == '' or b.models == nil or b.models[model] == true end

local function servable(free, model)
  for _, b in ipairs(free) do if serves(b, model) then return true end end
  return false
end

-- The first entry of a sorted set that a free backend serves (of model ``only`` when given);
-- expired ones leave on the way.
local function first_servable(key, free, only)
  for _, m in ipairs(redis.call('ZRANGE', key, 0, SCAN - 1)) do
    local id = id_of(m)
    local e = load(id)
    if not e then
      redis.call('ZREM', key, m) -- stale
    elseif tonumber(e.ex) <= now then
      unqueue(id, e) -- past its queue deadline: never granted (its replica answers the client)
      forget(id, e)
    elseif servable(free, e.md) and (only == nil or e.md == only) then
      return e
    end
  end
  return nil
end

-- The policy's next entry: per tenant its head (the oldest overdue entry if it arrived before the
-- policy's head, else the best band's lowest score), then among tenants: the head's band (an
-- overdue head joins the best band waiting anywhere), the tenant's start tag, fewer waiting, arrival.
-- ``only``: consider the entries of that model alone.
local function choose(free, only)
  local best, heads = nil, {}
  for _, tn in ipairs(redis.call('SMEMBERS', P .. 'act')) do
    local dk, ok = P .. 'due:' .. tn, P .. 'over:' .. tn
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', dk, '-inf', '(' .. f(now))) do
      redis.call('ZREM', dk, m)
      local a = redis.call('HGET', P .. 'e:' .. id_of(m), 'a')
      if a then redis.call('ZADD', ok, a, m) end
    end
    local bands = redis.call('ZRANGE', P .. 'bands:' .. tn, 0, -1)
    if #bands > 0 then
      local best_here = tonumber(bands[1])
      if best == nil or best_here < best then best = best_here end
      local head = nil
      for _, band in ipairs(bands) do
        head = first_servable(P .. 'q:' .. tn .. ':' .. band, free, only)
        if head then break end
      end
      local cand = first_servable(ok, free, only)
      local promoted = false
      if cand and (head == nil or tonumber(cand.a) < tonumber(head.a)) then
        head, promoted = cand, true
      end
      if head then
        table.insert(heads, {
          head = head,
          overdue = promoted or tonumber(head.dl) < now,
          tag = num(redis.call('HGET', P .. 'ten', tn), 0),
          waiting = num(redis.call('HGET', P .. 'tw', tn), 0),
        })
      end
    end
  end
  local pick, pick_key = nil, nil
  for _, h in ipairs(heads) do
    local band = tonumber(h.head.p)
    if h.overdue then band = best end
    local key = { band, h.tag, h.waiting, tonumber(h.head.sq) }
    local better = pick_key == nil
    if not better then
      for i = 1, 4 do
        if key[i] ~= pick_key[i] then better = key[i] < pick_key[i]; break end
      end
    end
    if better then pick, pick_key = h.head, key end
  end
  return pick
end

local function grant(e, free)
  local chosen = nil
  for _, b in ipairs(free) do
    if serves(b, e.md) then
      if e.md ~= '' and redis.call('HGET', P .. 'holds', b.name) == e.md then chosen = b; break end
      if chosen == nil then chosen = b end
    end
  end
  local taken = {}
  for _, s in ipairs(redis.call('ZRANGE', P .. 'lease:' .. chosen.name, 0, -1)) do taken[tonumber(s)] = true end
  local slot = 0
  while taken[slot] do slot = slot + 1 end
  local id, tn = e.id, e.t
  redis.call('HINCRBY', P .. 'tf', tn, 1) -- in flight before it stops waiting: its tenant stays active
  local tag = num(redis.call('HGET', P .. 'ten', tn), 0)
  local w = num(redis.call('HGET', P .. 'twt', tn), 1)
  redis.call('HSET', meta, 'vt', f(tag))
  redis.call('HSET', P .. 'ten', tn, f(tag + tonumber(e.pr) / w))
  unqueue(id, e)
  redis.call('ZADD', P .. 'lease:' .. chosen.name, f(now + lease_s), slot)
  redis.call('HSET', P .. 'lid:' .. chosen.name, slot, id)
  redis.call('HSET', P .. 'e:' .. id, 'st', 'r', 'b', chosen.name, 's', slot, 'g', f(now))
  redis.call('SADD', P .. 'rr:' .. e.r, id)
  if e.md ~= '' then
    local held = redis.call('HGET', P .. 'holds', chosen.name)
    if held and held ~= e.md then redis.call('HSET', P .. 'switched', chosen.name, f(now)) end
    redis.call('HSET', P .. 'holds', chosen.name, e.md)
  end
  push(e.r, 'grant ' .. id .. ' ' .. chosen.name .. ' ' .. slot)
end

-- The model switch bound (``bound`` seconds, 0 = off): when the policy's next entry would make
-- every free backend that serves it switch models, the first such backend keeps its model for the
-- best entry of that model instead, until the entry has been put off ``bound`` seconds (since it
-- arrived, or since that backend's last switch). Nil: no reason to hold.
local function held_instead(e, free, bound)
  if bound <= 0 or e.md == '' then return nil end
  local keeper, keeps = nil, nil
  for _, b in ipairs(free) do
    if serves(b, e.md) then
      local h = redis.call('HGET', P .. 'holds', b.name)
      if (not h) or h == e.md then return nil end -- it goes where no switch is needed
      if keeper == nil then keeper, keeps = b, h end
    end
  end
  if keeper == nil then return nil end
  local since = math.max(tonumber(e.a), num(redis.call('HGET', P .. 'switched', keeper.name), 0))
  if now - since >= bound then return nil end -- put off long enough: the switch is due
  return choose({ keeper }, keeps)
end

local function grant_step()
  if now < num(redis.call('HGET', meta, 'quiet_until'), 0) then return end
  local bound = num(redis.call('HGET', meta, 'bound'), 0)
  while true do
    local free = free_backends()
    if #free == 0 then return end
    local e = choose(free)
    if e == nil then return end
    e = held_instead(e, free, bound) or e
    grant(e, free)
  end
end

-- ARGV from i: id, tenant, weight, band, model, score, predicted_s, guard_s, deadline_s, supersede key
local function add(i)
  local id, tn, w, p, md = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), tostring(tonumber(ARGV[i + 3])), ARGV[i + 4]
  local sc, pr, guard_s, deadline_s, sk = ARGV[i + 5], ARGV[i + 6], tonumber(ARGV[i + 7]), tonumber(ARGV[i + 8]), ARGV[i + 9]
  local old = load(id)
  if old then
    if old.st ~= 'w' then return end -- granted already: never queued twice
    unqueue(id, old)
    forget(id, old)
  end
  if sk ~= '' then
    local prev = redis.call('HGET', P .. 'sk', sk)
    if prev and prev ~= id then
      local pe = load(prev)
      if pe and pe.st == 'w' then
        unqueue(prev, pe)
        forget(prev, pe)
        push(pe.r, 'superseded ' .. prev)
      elseif pe then
        push(pe.r, 'abort ' .. prev)
      end
    end
    redis.call('HSET', P .. 'sk', sk, id)
  end
  local seq = redis.call('INCR', P .. 'seq')
  local m = string.format('%016d:', seq) .. id
  if num(redis.call('HGET', P .. 'tw', tn), 0) <= 0 then
    -- Becomes active: it starts at the virtual time (one still in service keeps a later tag).
    local vt = num(redis.call('HGET', meta, 'vt'), 0)
    local tag = redis.call('HGET', P .. 'ten', tn)
    if tag then
      if tonumber(tag) < vt then redis.call('HSET', P .. 'ten', tn, f(vt)) end
    else
      redis.call('HSET', P .. 'ten', tn, f(vt))
      redis.call('HSET', P .. 'twt', tn, f(w))
    end
    redis.call('SADD', P .. 'act', tn)
  end
  redis.call('HINCRBY', P .. 'tw', tn, 1)
  local dl, ex = now + guard_s, now + deadline_s
  redis.call('HSET', P .. 'e:' .. id, 'r', me, 't', tn, 'p', p, 'md', md, 'sc', sc, 'pr', pr, 'a', f(now),
    'sq', seq, 'dl', f(dl), 'ex', f(ex), 'sk', sk, 'st', 'w', 'm', m)
  redis.call('ZADD', P .. 'q:' .. tn .. ':' .. p, sc, m)
  redis.call('ZADD', P .. 'bands:' .. tn, p, p)
  if guard_s < 1e299 then redis.call('ZADD', P .. 'due:' .. tn, f(dl), m) end
  redis.call('SADD', P .. 'rw:' .. me, id)
end

-- The entries that go before a waiting one: every better band, the overdue ones, and in its own
-- band those of every tenant with a lower score (fair share between tenants is not replayed).
local function placed(id)
  local mine = load(id)
  if not mine or mine.st ~= 'w' then return { '0', '0' } end
  local p, sc = tonumber(mine.p), tonumber(mine.sc)
  local seen, count, secs = { [id] = true }, 0, 0
  local function count_in(members)
    for _, m in ipairs(members) do
      local other = id_of(m)
      if not seen[other] then
        seen[other] = true
        count = count + 1
        secs = secs + num(redis.call('HGET', P .. 'e:' .. other, 'pr'), 0)
      end
    end
  end
  for _, tn in ipairs(redis.call('SMEMBERS', P .. 'act')) do
    for _, band in ipairs(redis.call('ZRANGE', P .. 'bands:' .. tn, 0, -1)) do
      local b = tonumber(band)
      if b < p then
        count_in(redis.call('ZRANGE', P .. 'q:' .. tn .. ':' .. band, 0, -1))
      elseif b == p then
        count_in(redis.call('ZRANGEBYSCORE', P .. 'q:' .. tn .. ':' .. band, '-inf', f(sc)))
      end
    end
    count_in(redis.call('ZRANGE', P .. 'over:' .. tn, 0, -1))
  end
  -- It waits, so every slot it may take is busy: what the running ones have left is ahead too.
  for _, b in ipairs(redis.call('HKEYS', P .. 'bk')) do
    local held = redis.call('HGETALL', P .. 'lid:' .. b)
    for i = 2, #held, 2 do
      local run = redis.call('HMGET', P .. 'e:' .. held[i], 'pr', 'g')
      if run[1] and run[2] then secs = secs + math.max(0, tonumber(run[1]) - (now - tonumber(run[2]))) end
    end
  end
  return { tostring(count), f(secs) }
end

local function view()
  local entries, leases, replicas, tenants = {}, {}, {}, {}
  local reps = redis.call('ZRANGE', P .. 'rep', 0, -1, 'WITHSCORES')
  for i = 1, #reps, 2 do
    table.insert(replicas, { reps[i], f(now - tonumber(reps[i + 1])) })
    for _, id in ipairs(redis.call('SMEMBERS', P .. 'rw:' .. reps[i])) do
      local e = load(id)
      if e and e.st == 'w' then
        table.insert(entries, { id, e.r, e.t, e.p, e.md, e.sc, e.pr, f(now - tonumber(e.a)), e.sq,
          (tonumber(e.dl) < now) and '1' or '0', f(tonumber(e.ex) - now) })
      end
    end
  end
  for _, b in ipairs(redis.call('HKEYS', P .. 'bk')) do
    local held = redis.call('ZRANGE', P .. 'lease:' .. b, 0, -1, 'WITHSCORES')
    for i = 1, #held, 2 do
      local id = redis.call('HGET', P .. 'lid:' .. b, held[i]) or ''
      local r = ''
      if id ~= '' then r = redis.call('HGET', P .. 'e:' .. id, 'r') or '' end
      table.insert(leases, { b, held[i], id, r, f(tonumber(held[i + 1]) - now) })
    end
  end
  local tags = redis.call('HGETALL', P .. 'ten')
  for i = 1, #tags, 2 do
    table.insert(tenants, { tags[i], tags[i + 1], redis.call('HGET', P .. 'twt', tags[i]) or '1',
      redis.call('HGET', P .. 'tw', tags[i]) or '0' })
  end
  local backends = {}
  local bk = redis.call('HGETALL', P .. 'bk')
  for i = 1, #bk, 2 do
    table.insert(backends, { bk[i], bk[i + 1], redis.call('HGET', P .. 'holds', bk[i]) or '' })
  end
  local quiet = num(redis.call('HGET', meta, 'quiet_until'), 0) - now
  return cjson.encode({ entries = entries, leases = leases, replicas = replicas, tenants = tenants,
    backends = backends, quiet_s = f(quiet > 0 and quiet or 0), epoch = redis.call('HGET', meta, 'epoch') or '' })
end

if cmd == 'view' then return view() end -- read-only: no tick, no grant

local epoch = ensure_meta()
local out = { epoch }
-- Every call is a heartbeat. A replica that calls after it was dropped (or after the store lost
-- its state) is marked: its next renew answers reset, so that it sends its waiting entries again.
if cmd ~= 'leave' then
  if cmd == 'join' then
    redis.call('SREM', P .. 'gone', me)
  elseif not live(me) then
    redis.call('SADD', P .. 'gone', me)
  end
  redis.call('ZADD', P .. 'rep', f(now), me)
end

if cmd == 'join' then
  local n = tonumber(ARGV[4])
  for i = 0, n - 1 do
    local name = ARGV[5 + 3 * i]
    redis.call('HSET', P .. 'bk', name, ARGV[6 + 3 * i])
    redis.call('HSET', P .. 'bm', name, ARGV[7 + 3 * i])
  end
  if ARGV[5 + 3 * n] then redis.call('HSET', meta, 'bound', ARGV[5 + 3 * n]) end
  tick()
  grant_step()
elseif cmd == 'enqueue' then
  tick()
  add(4)
  grant_step()
  local where = placed(ARGV[4])
  table.insert(out, where[1])
  table.insert(out, where[2])
elseif cmd == 'cancel' then
  local id = ARGV[4]
  local e = load(id)
  local withdrawn = '1'
  if e and e.st == 'w' then
    unqueue(id, e)
    forget(id, e)
  elseif e then
    withdrawn = '0' -- granted: its grant is on its way
  end
  tick()
  grant_step()
  table.insert(out, withdrawn)
elseif cmd == 'release' then
  local id = ARGV[4]
  local e = load(id)
  if e and e.st == 'w' then
    unqueue(id, e)
    forget(id, e)
  elseif e then
    local service_s = nil
    if ARGV[5] ~= '' then service_s = tonumber(ARGV[5]) end
    finish(id, e, service_s)
  end
  tick()
  grant_step()
elseif cmd == 'renew' then
  -- Own leases first: one expired but not yet reclaimed is still this replica's (nobody else can
  -- have its slot), so it is extended rather than lost.
  local reset = redis.call('SREM', P .. 'gone', me) == 1
  local n = tonumber(ARGV[4])
  local lost = {}
  for i = 0, n - 1 do
    local id, b, s = ARGV[5 + 3 * i], ARGV[6 + 3 * i], ARGV[7 + 3 * i]
    local cur = redis.call('HGET', P .. 'lid:' .. b, s)
    if cur and cur ~= id then
      -- This replica runs id on that slot: an earlier request of its own there ended while it
      -- could not say so (Redis was gone). The replica knows its own slots: that lease goes.
      local ce = load(cur)
      if ce and ce.r == me then
        finish(cur, ce, nil)
        cur = nil
      end
    end
    if cur == id then
      redis.call('ZADD', P .. 'lease:' .. b, f(now + lease_s), s)
    elseif (not cur) and tonumber(s) < num(redis.call('HGET', P .. 'bk', b), 0) then
      -- The store lost it and the slot is free: take it back (no fair-share account: adopted).
      redis.call('ZADD', P .. 'lease:' .. b, f(now + lease_s), s)
      redis.call('HSET', P .. 'lid:' .. b, s, id)
      local e = load(id)
      if e and e.st == 'w' then
        unqueue(id, e)
        forget(id, e)
        e = nil
      elseif e and e.b and e.b ~= '' and not (e.b == b and e.s == s) then
        -- It was also granted another slot (a late enqueue, run when Redis came back): that one goes.
        if redis.call('HGET', P .. 'lid:' .. e.b, e.s) == id then
          redis.call('ZREM', P .. 'lease:' .. e.b, e.s)
          redis.call('HDEL', P .. 'lid:' .. e.b, e.s)
        end
      end
      if e == nil then
        redis.call('HSET', P .. 'e:' .. id, 'r', me, 't', '', 'pr', '0', 'st', 'r', 'adopted', '1', 'sk', '')
      end
      redis.call('HSET', P .. 'e:' .. id, 'b', b, 's', s)
      redis.call('SADD', P .. 'rr:' .. me, id)
    else
      table.insert(lost, id)
    end
  end
  tick()
  grant_step()
  local names = redis.call('ZRANGE', P .. 'rep', 0, -1)
  table.sort(names)
  table.insert(out, reset and '1' or '0')
  table.insert(out, tostring(#names))
  for _, r in ipairs(names) do table.insert(out, r) end
  for _, id in ipairs(lost) do table.insert(out, id) end
elseif cmd == 'resync' then
  drop_waiting(me)
  tick()
  local n = tonumber(ARGV[4])
  for i = 0, n - 1 do
    -- The replica says it waits: a grant to it that it never took (handed out while it could not
    -- trust its messages) is given back, its charge refunded, and the entry queued again.
    local id = ARGV[5 + 10 * i]
    local old = load(id)
    if old and old.st ~= 'w' and old.r == me then finish(id, old, 0) end
    add(5 + 10 * i)
  end
  grant_step()
elseif cmd == 'leave' then
  drop_replica(me)
  redis.call('SREM', P .. 'gone', me)
  tick()
  grant_step()
elseif cmd == 'tick' then
  tick()
  grant_step()
else
  return redis.error_reply('unknown command ' .. tostring(cmd))
end
return out
