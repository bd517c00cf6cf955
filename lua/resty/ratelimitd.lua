-- resty.ratelimitd: the OpenResty / ngx_lua client of the ratelimitd daemon.
--
-- Speaks the daemon's binary protocol (docs/PROTOCOL.md) over a pooled
-- cosocket to a Unix socket, applies the location's fail policy when the
-- daemon is unreachable or slow, and sets the RateLimit headers.
--
-- Object form: options are validated once, the constant part of the request
-- frame is built once, and each request only encodes its id, cost and key.
--
--   init_by_lua_block    { local ratelimitd = require "resty.ratelimitd"
--                          ratelimitd.configure{ socket = "unix:/run/ratelimitd/ratelimitd.sock" }
--                          order = assert(ratelimitd.new{ limit = 1000, window_ms = 1000, on_error = "closed" }) }
--   access_by_lua_block  { order:limit("order:" .. ngx.var.http_x_tenant_id) }
--
-- Named policy (limit, window, overrides and allowlist live in the daemon's
-- ratelimitd.toml, docs/POLICIES.md; the location keeps its fail policy):
--
--   init_by_lua_block    { order = assert(require("resty.ratelimitd").new("order")) }
--   access_by_lua_block  { order:limit(ngx.var.http_x_tenant_id) }
--
-- Table form (validates and builds everything on every call; still supported):
--
--   access_by_lua_block  { require("resty.ratelimitd").limit{ key = "order:" .. ngx.var.http_x_tenant_id,
--                                                               limit = 1000, window_ms = 1000, on_error = "closed" } }
--
-- This file is the facade; each concern has a module of its own under
-- resty/ratelimitd/ (docs/NGINX.md, "The client's modules"):
--   wire         frame encoding and decoding, the codes tables
--   config       configure{} and its settings, the rate-limited failure
--                lines
--   options      the one table of option specs of every constructor
--   conn         the pooled connection to the daemon, the monotonic clock
--                its sends are timed by
--   cache        the denial cache in the shared dict
--   http         enforce(): the one HTTP decision of every limiter kind,
--                the location's fail policy (open, closed, local quota),
--                the quota headers per style, the problem body
--   kind         what every limiter kind shares: class, arguments (what a
--                key from request data is sent as), constructor, the
--                decision from a worker share first, a policy limiter's
--                frame header
--   limiter      inline limits (new{ limit, window_ms })
--   form         the table forms limit{} and check{}
--   policy       one named policy
--   multi        several named policies, refundable checks, reserves (settle = true)
--   refund       refund() of a refundable check
--   settle       settle() of a reserve: the actual cost after the response
--   concurrency  concurrency limits: enter() and leave()
--   request      what a request keeps across internal redirects: its
--                decisions (one count per request), its decision table,
--                its concurrency leases
--   verify       what the daemon says of a policy (DESCRIBE_POLICY), how
--                a limiter takes it, the worker-start verifier of the
--                policy names used
--   limiters     build{}: each limiter on its own, names verified at worker start
--   share        worker shares of the daemon's quota leases (share_dict)
--   client_key   the client's address as a key (IPv4 /32, IPv6 /64)

local config = require "resty.ratelimitd.config"
local options = require "resty.ratelimitd.options"
local limiter = require "resty.ratelimitd.limiter"
local policy = require "resty.ratelimitd.policy"
local multi = require "resty.ratelimitd.multi"
local concurrency = require "resty.ratelimitd.concurrency"
local form = require "resty.ratelimitd.form"
local refund = require "resty.ratelimitd.refund"
local settle = require "resty.ratelimitd.settle"

local type, error = type, error

local _M = { _VERSION = "0.1.0" }

--- Sets defaults for every later call; call once from init_by_lua*.
-- Limiters made with new() read these at each request, so configure() may
-- run before or after they are created.
_M.configure = config.configure

--- Makes a limiter: validates the options once and precomputes the constant
-- part of its request frame. Options as in the table form, without key and
-- cost (given per request to lim:limit(key, cost) and lim:check(key, cost)).
-- Returns the object, or nil and a message on a bad or unknown option.
-- Raises only when not given a table (a call as ratelimitd:new{} included):
-- that is a bug in the code, not in a value, as configure() raises for it.
function _M.new(opts)
    -- A string that cannot be a policy name (e.g. "limit=10") is a bug in
    -- the code, raised like any other non-table.
    if options.valid_policy_name(opts) then
        opts = { policy = opts }
    end
    if type(opts) ~= "table" or opts == _M then
        error("new: expects a policy name or a table of options: ratelimitd.new(\"order\"), ratelimitd.new{ limit = ..., window_ms = ... }", 2)
    end
    if opts.policies ~= nil or (opts.policy ~= nil and (opts.refundable ~= nil or opts.settle ~= nil)) then
        return multi.new(opts)
    end
    if opts.policy ~= nil then
        return policy.new(opts)
    end
    return limiter.new(opts)
end

--- Concurrency limiter (resty/ratelimitd/concurrency.lua): the object, or
-- nil and a message.
function _M.concurrency(opts)
    if type(opts) ~= "table" or opts == _M then
        error("concurrency: expects a table of options", 2)
    end
    return concurrency.new(opts)
end

--- Table forms of limit and check (resty/ratelimitd/form.lua).
_M.limit = form.limit
_M.check = form.check

--- Takes back a refundable check's admissions (resty/ratelimitd/refund.lua).
_M.refund = refund.refund

--- Settles a reserve (new{ policy(ies) = ..., settle = true }) to the actual
-- cost (resty/ratelimitd/settle.lua).
_M.settle = settle.settle

--- The request's decision table (ngx.ctx.ratelimitd), also after an
-- internal redirect (error_page, try_files, ngx.exec), which clears
-- ngx.ctx: for refund(res.handle) and settle(res.handle, actual) in
-- log_by_lua* wherever the request ends. Needs the snippet's
-- `map $request_id` line (resty/ratelimitd/request.lua).
_M.decision = require("resty.ratelimitd.request").decision

--- For init_worker_by_lua*, when limiters are made with new() and not
-- with resty.ratelimitd.limiters.build{} (which does it): asks the daemon,
-- in a timer, about every policy name this worker's limiters use; unknown
-- names are logged (one error line each), policy limiters take their
-- policy's window and local quota. Returns true, or nil and why not.
_M.verify_policies = require("resty.ratelimitd.verify").schedule

--- For log_by_lua*: releases the request's concurrency leases.
_M.leave = concurrency.leave

return _M
