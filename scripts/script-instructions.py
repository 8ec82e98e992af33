#!/usr/bin/env python3
"""Redis's instructions inside EVALSHA per call, counted by callgrind (load does not move them):
lua/single.lua against lua/bucket.lua + lua/apply.lua for one decision per call and for calls of
10 lone decisions on buckets of their own (single10, apply10: per call and per decision), and two
floors (a bare bucket: TIME, GET, SET; INCR inside a script). Each variant runs on a fresh
redis-server under valgrind, 1,000 buckets made first, then 200 calls counted; the variants
alternate, twice. Usage: scripts/script-instructions.py [variant ...]  (make script-instructions)."""
import glob, os, re, socket, struct, subprocess, sys, time
MAIN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
def resp(*args):
    out = b'*%d\r\n' % len(args)
    for a in args:
        if isinstance(a, str): a = a.encode()
        out += b'$%d\r\n%s\r\n' % (len(a), a)
    return out
class C:
    def __init__(s, port):
        s.s = socket.create_connection(('127.0.0.1', port)); s.f = s.s.makefile('rb')
    def read(s):
        l = s.f.readline()
        t, r = l[:1], l[1:-2]
        if t == b'+': return r
        if t == b'-': raise Exception(r.decode())
        if t == b':': return int(r)
        if t == b'$':
            n = int(r)
            if n < 0: return None
            d = s.f.read(n + 2); return d[:-2]
        if t == b'*': return [s.read() for _ in range(int(r))]
    def cmd(s, *a):
        s.s.sendall(resp(*a)); return s.read()
def nums_apply(n=1, capacity=1000000, refill=0.001):
    """One group of n requests, each one decision on bucket j under the one limit."""
    b = struct.pack('<QdBQIIII', 10000, 0.1, 0, 1000, n, 1, 1, 0)
    b += struct.pack('<QdI', capacity, refill, 0)
    b += struct.pack('<I', n)
    for j in range(1, n + 1):
        b += struct.pack('<I', 1) + struct.pack('<IIQBBQQQ', j, 1, 1, 0, 1, 0, 0, 0)
    return b
MIN = r'''
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local v = redis.call('GET', KEYS[1])
local tokens, ts = 1000000, now
if v then tokens, ts = struct.unpack('<dd', v) end
local cost, cap, refill = struct.unpack('<I8I8d', ARGV[1])
tokens = math.min(cap, tokens + refill * (now - ts) / 1e6)
local ok = tokens >= cost
if ok then tokens = tokens - cost end
redis.call('SET', KEYS[1], struct.pack('<dd', tokens, now), 'PX', 3600000)
return struct.pack('<dd', ok and 1 or 0, tokens)
'''
INCR = "return redis.call('INCR', KEYS[1])"
def run(variant, calls=200, keys=1000):
    port = 27000 + os.getpid() % 1000
    out = f'/tmp/cg.{variant}.%p'
    for f in glob.glob(f'/tmp/cg.{variant}.*'): os.remove(f)
    p = subprocess.Popen(['valgrind', '--tool=callgrind', f'--callgrind-out-file={out}',
        '--toggle-collect=evalShaCommand', 'redis-server', '--port', str(port), '--hz', '1',
        '--save', '', '--appendonly', 'no', '--protected-mode', 'no'],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try: c = C(port); c.cmd('PING'); break
        except Exception: time.sleep(0.2)
    n = int(variant[len(variant.rstrip('0123456789')):] or 1)  # decisions per call
    keyname = lambda i: 'rl:{k%d}' % i
    ks = lambda i: [keyname((i * n + j) % keys) for j in range(n)]
    if variant.startswith('apply'):
        text = open(f'{MAIN}/lua/bucket.lua').read() + open(f'{MAIN}/lua/apply.lua').read()
        args = lambda i: (1, ks(i)[0], 'apply', nums_apply(n), *ks(i), '', '')
    elif variant.startswith('single'):
        text = open(f'{MAIN}/lua/single.lua').read()
        one = struct.pack('<QdQB', 1000000, 0.001, 1, 0)
        args = lambda i: (1, ks(i)[0], one * n, '', *ks(i)[1:])
    elif variant == 'min':
        text = MIN; args = lambda i: (1, keyname(i % keys), struct.pack('<QQd', 1, 1000000, 0.001))
    else:
        text = INCR; args = lambda i: (1, keyname(i % keys))
    sha = c.cmd('SCRIPT', 'LOAD', text).decode()
    call = lambda i: c.cmd('EVALSHA', sha, *map(lambda a: str(a) if isinstance(a, int) else a, args(i)))
    for i in range((keys + n - 1) // n): call(i)
    subprocess.run(['callgrind_control', '-z', str(p.pid)], stdout=subprocess.DEVNULL)
    for j in range(calls): call(j)
    subprocess.run(['callgrind_control', '-d', str(p.pid)], stdout=subprocess.DEVNULL)
    time.sleep(1)
    p.terminate(); p.wait()
    files = sorted(glob.glob(f'/tmp/cg.{variant}.*'), key=os.path.getmtime)
    best = None
    for f in files:
        txt = open(f, errors='replace').read()
        m = re.search(r'^summary: (\d+)', txt, re.M) or re.search(r'^totals: (\d+)', txt, re.M)
        if m and 'Trigger: dump' in txt: best = int(m.group(1))
    per = f', {best / calls / n / 1000:.1f}k per decision' if best and n > 1 else ''
    print(f'{variant}: {best / calls / 1000:.1f}k instructions per call inside EVALSHA{per}' if best else f'{variant}: no dump {files}')
for v in sys.argv[1:] or 2 * ['single', 'apply', 'single10', 'apply10', 'min', 'incr']:
    run(v)
