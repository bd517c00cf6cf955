import json,sys,glob
for d in sorted(glob.glob(sys.argv[1]+'/*-*/')):
    recs=[json.loads(l) for l in open(d+'fleet.raw.jsonl')]
    out=[]
    for delay in sorted({r['delay_ms'] for r in recs}):
        def get(path,case,c1=False):
            for r in recs:
                if r['delay_ms']==delay and r['path']==path and case in r['url'] and ((r['conns']==1)==c1): return r
        dr=get('direct','admit'); rl=get('rl','admit'); sh=get('rl','shared')
        a=sh['audit'] if sh else {}
        under = 1-a['mean_in_window']/a['limit'] if a.get('mean_in_window') else float('nan')
        out.append('%.2fms %.2fx cpu %.1f/%.1f=%.3f calls %.3f failpol %d under %.1f%%'%(delay, rl['rps']/dr['rps'], rl['redis_cpu_us_per_decision'], dr['redis_cpu_us_per_decision'], rl['redis_cpu_us_per_decision']/dr['redis_cpu_us_per_decision'], rl['redis_calls_per_decision'], rl['fail_policy'], 100*under))
    print(d.split('/')[-2], ' | '.join(out))
