import json,sys,glob
rows=[]
for d in sorted(glob.glob(sys.argv[1]+'/*-*/')):
    recs=[json.loads(l) for l in open(d+'fleet.raw.jsonl')]
    out={}
    for b in ['single','cluster']:
        def get(path,case):
            for r in recs:
                if r['backend']==b and r['path']==path and case in r['url'] and r['conns']>1: return r
        dr=get('direct','admit'); rl=get('rl','admit')
        sh=[r for r in recs if r['backend']==b and r['path']=='rl' and 'shared' in r['url']]
        a=sh[0]['audit'] if sh else {}
        under = 1-a['mean_in_window']/a['limit'] if a.get('mean_in_window') else None
        if dr and rl:
            out[b]=(rl['rps']/dr['rps'], rl['redis_cpu_us_per_decision'], dr['redis_cpu_us_per_decision'], rl['redis_cpu_us_per_decision']/dr['redis_cpu_us_per_decision'], rl['redis_calls_per_decision'], under, a.get('max_in_any_window'))
    print(d.split('/')[-2], ' | '.join('%s %.2fx cpu %.1f/%.1f=%.3fx calls %.4f under %.1f%% max %s'%(b,*v[:5],100*(v[5] or 0),v[6]) for b,v in out.items()))
