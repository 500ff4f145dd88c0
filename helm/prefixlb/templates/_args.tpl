{{/*
Container arguments: values -> `prefixlb router` / `prefixlb worker` flags, and the vLLM servers'
flags. The entrypoint of each prefixlb image is the command itself, so these are only flags.
tests/unit/test_helm_chart.py checks that every flag rendered here is one the command really
accepts; tests/unit/test_helm_vllm.py parses the vLLM flags with vLLM's own parser.
*/}}

{{/*
Append "--flag=value" to .acc.args when value is set (not null, not empty). Numbers from values
arrive as float64, and %v would print 1048576 as 1.048576e+06, which an integer flag refuses:
whole numbers are printed as integers.
*/}}
{{- define "prefixlb.flag" -}}
{{- if not (kindIs "invalid" .value) -}}
{{- $text := toString .value -}}
{{- if and (kindIs "float64" .value) (eq (floor .value) .value) -}}
{{- $text = printf "%d" (int64 .value) -}}
{{- end -}}
{{- if ne $text "" -}}
{{- $_ := set .acc "args" (append .acc.args (printf "%s=%s" .flag $text)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "prefixlb.routerArgs" -}}
{{- $r := .Values.router -}}
{{- $acc := dict "args" (list "--host=0.0.0.0" (printf "--port=%d" (int $r.port))) -}}
{{- if gt (int (default 1 $r.processes)) 1 -}}
{{- if not (include "prefixlb.hasRedis" .) -}}
{{- fail "router.processes > 1 needs Redis (redis.enabled, redis.url or redis.existingSecret): the processes share their state through it" -}}
{{- end -}}
{{- $_ := set $acc "args" (append $acc.args (printf "--processes=%d" (int $r.processes))) -}}
{{- end -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--policy" "value" $r.policy) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--affinity" "value" $r.affinity) -}}
{{- if eq (toString $r.adapterRouting) "false" -}}
{{- $_ := set $acc "args" (append $acc.args "--no-adapter-routing") -}}
{{- end -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--adapter-spare" "value" $r.adapterSpare) -}}
{{- range $r.sessionHeaders -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--session-header" "value" .) -}}
{{- end -}}
{{- range $r.sessionFields -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--session-field" "value" .) -}}
{{- end -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--chunk-size" "value" .Values.chunkSize) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--index-max-entries" "value" $r.index.maxEntries) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--index-optimistic-ttl" "value" $r.index.optimisticTtlSeconds) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--index-confirmed-ttl" "value" $r.index.confirmedTtlSeconds) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--max-inflight-per-worker" "value" $r.limits.maxInflightPerWorker) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--max-inflight" "value" $r.limits.maxInflight) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--max-queue" "value" $r.limits.maxQueue) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--max-queue-bytes" "value" $r.limits.maxQueueBytes) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--queue-timeout" "value" $r.limits.queueTimeoutSeconds) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--max-body-bytes" "value" $r.limits.maxBodyBytes) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--body-timeout" "value" $r.limits.bodyTimeoutSeconds) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--max-attempts" "value" $r.limits.maxAttempts) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--retry-deadline" "value" $r.limits.retryDeadlineSeconds) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--connect-timeout" "value" $r.limits.connectTimeoutSeconds) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--read-timeout" "value" $r.limits.readTimeoutSeconds) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--health-interval" "value" $r.health.intervalSeconds) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--health-jitter" "value" $r.health.jitter) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--health-timeout" "value" $r.health.timeoutSeconds) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--unhealthy-after" "value" $r.health.unhealthyAfter) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--breaker-cool-down" "value" $r.health.breakerCoolDownSeconds) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--breaker-max-cool-down" "value" $r.health.breakerMaxCoolDownSeconds) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--half-open-successes" "value" $r.health.halfOpenSuccesses) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--half-open-max-inflight" "value" $r.health.halfOpenMaxInflight) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--registry-grace" "value" $r.health.registryGraceSeconds) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--prewarm-top" "value" $r.prewarm.top) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--prewarm-max-bytes" "value" $r.prewarm.maxBytes) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--prewarm-timeout" "value" $r.prewarm.timeoutSeconds) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--log-level" "value" $r.logLevel) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--log-format" "value" $r.logFormat) -}}
{{- if and $r.adminPort (eq (int $r.adminPort) (int $r.port)) -}}
{{- fail "router.adminPort must differ from router.port (null: the admin API on the API port)" -}}
{{- end -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--admin-port" "value" $r.adminPort) -}}
{{- /* The bundled Redis's URL carries a password: it comes through the environment (prefixlb.redisEnv). */ -}}
{{- if and (not .Values.redis.enabled) .Values.redis.url -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--redis" "value" .Values.redis.url) -}}
{{- end -}}
{{- if include "prefixlb.hasRedis" . -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--redis-prefix" "value" .Values.redis.keyPrefix) -}}
{{- end -}}
{{- if eq .Values.discovery.mode "static" -}}
{{- if .Values.worker.enabled -}}
{{- range $i := until (int .Values.worker.replicas) -}}
{{- $url := printf "http://%s-%d.%s-headless.%s.svc:%d" (include "prefixlb.workerName" $) $i (include "prefixlb.workerName" $) $.Release.Namespace (int $.Values.worker.port) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--worker" "value" $url) -}}
{{- end -}}
{{- end -}}
{{- else if eq .Values.discovery.mode "kubernetes" -}}
{{- $selector := .Values.discovery.selector -}}
{{- if not $selector -}}
{{- $selector = printf "app.kubernetes.io/name=%s,app.kubernetes.io/instance=%s,app.kubernetes.io/component=worker" (include "prefixlb.name" .) .Release.Name -}}
{{- end -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--k8s-selector" "value" $selector) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--k8s-namespace" "value" .Release.Namespace) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--k8s-port" "value" (int .Values.worker.port)) -}}
{{- else if ne .Values.discovery.mode "redis" -}}
{{- fail (printf "discovery.mode must be redis, kubernetes or static, not %q" .Values.discovery.mode) -}}
{{- else if not (include "prefixlb.hasRedis" .) -}}
{{- fail "discovery.mode=redis needs a Redis: set redis.enabled=true, redis.url or redis.existingSecret, or use discovery.mode=static or kubernetes" -}}
{{- end -}}
{{- range $r.extraWorkers -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--worker" "value" .) -}}
{{- end -}}
{{- range $r.workers -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--worker" "value" (include "prefixlb.workerSpec" .)) -}}
{{- end -}}
{{- range (include "prefixlb.vllmWorkerSpecs" . | fromYamlArray) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--worker" "value" .) -}}
{{- end -}}
{{- range $r.tokenizers -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--tokenizer" "value" (printf "%s=%s" .model .path)) -}}
{{- end -}}
{{- if $r.workerAllow -}}
{{- range $r.workerAllow -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--worker-allow" "value" .) -}}
{{- end -}}
{{- /* The worker URLs the chart passes itself are allowed: static DNS names, extraWorkers. */ -}}
{{- if and (eq .Values.discovery.mode "static") .Values.worker.enabled -}}
{{- $pattern := printf "*.%s-headless.%s.svc:%d" (include "prefixlb.workerName" $) $.Release.Namespace (int $.Values.worker.port) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--worker-allow" "value" $pattern) -}}
{{- end -}}
{{- range $r.extraWorkers -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--worker-allow" "value" (urlParse .).host) -}}
{{- end -}}
{{- /* router.workers: the URL's host:port, and a KV-event socket's when it is on another host
(the router checks a KV-event host against the allow-list without its port). */ -}}
{{- range $r.workers -}}
{{- $url := urlParse .url -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--worker-allow" "value" $url.host) -}}
{{- range $endpoint := list .kvEvents .kvReplay -}}
{{- if and $endpoint (ne (urlParse $endpoint).hostname $url.hostname) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--worker-allow" "value" (urlParse $endpoint).host) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if .Values.vllm.enabled -}}
{{- $pattern := printf "*.%s-headless.%s.svc:%d" (include "prefixlb.vllmName" $) $.Release.Namespace (int $.Values.vllm.port) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--worker-allow" "value" $pattern) -}}
{{- end -}}
{{- end -}}
{{- toYaml (concat $acc.args $r.extraArgs) -}}
{{- end -}}

{{- define "prefixlb.workerArgs" -}}
{{- $w := .Values.worker -}}
{{- $acc := dict "args" (list "--host=0.0.0.0" (printf "--port=%d" (int $w.port)) "--worker-id=$(POD_NAME)") -}}
{{- if $w.simulate.enabled -}}
{{- $_ := set $acc "args" (append $acc.args "--simulate") -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--gpu" "value" $w.simulate.gpu) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--sim-model" "value" $w.simulate.model) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--time-scale" "value" $w.simulate.timeScale) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--sim-tp" "value" $w.simulate.tensorParallel) -}}
{{- else -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--model" "value" $w.model) -}}
{{- $device := $w.device -}}
{{- if not $device -}}{{- $device = ternary "cuda" "cpu" (gt (int $w.gpu.count) 0) -}}{{- end -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--device" "value" $device) -}}
{{- end -}}
{{- $drain := $w.drainTimeoutSeconds -}}
{{- if kindIs "invalid" $drain -}}{{- $drain = max 1 (sub (int $w.terminationGracePeriodSeconds) 15) -}}{{- end -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--drain-timeout" "value" $drain) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--served-model-name" "value" $w.servedModelName) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--kv-memory" "value" $w.kvMemory) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--kv-blocks" "value" $w.kvBlocks) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--block-size" "value" $w.blockSize) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--max-num-seqs" "value" $w.maxNumSeqs) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--max-num-batched-tokens" "value" $w.maxNumBatchedTokens) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--max-model-len" "value" $w.maxModelLen) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--attention-backend" "value" $w.attentionBackend) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--dtype" "value" $w.dtype) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--gpu-memory-utilization" "value" $w.gpuMemoryUtilization) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--chunk-size" "value" .Values.chunkSize) -}}
{{- if $w.lora.enabled -}}
{{- $_ := set $acc "args" (append $acc.args "--enable-lora") -}}
{{- range $w.lora.adapters -}}
{{- $path := .path -}}
{{- if not (hasPrefix "/" $path) -}}{{- $path = printf "%s/%s" (trimSuffix "/" $w.lora.volume.mountPath) $path -}}{{- end -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--lora" "value" (printf "%s=%s" .name $path)) -}}
{{- end -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--max-loras" "value" $w.lora.maxLoras) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--max-cpu-loras" "value" $w.lora.maxCpuLoras) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--max-lora-rank" "value" $w.lora.maxLoraRank) -}}
{{- end -}}
{{- /* The routers' body limit: what a router accepts, its worker accepts too. */ -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--max-body-bytes" "value" .Values.router.limits.maxBodyBytes) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--log-level" "value" $w.logLevel) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--log-format" "value" $w.logFormat) -}}
{{- if include "prefixlb.hasRedis" . -}}
{{- if and (not .Values.redis.enabled) .Values.redis.url -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--redis" "value" .Values.redis.url) -}}
{{- end -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--redis-prefix" "value" .Values.redis.keyPrefix) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--advertise" "value" (printf "http://$(POD_IP):%d" (int $w.port))) -}}
{{- end -}}
{{- toYaml (concat $acc.args $w.extraArgs) -}}
{{- end -}}

{{/*
One router.workers entry ({url, kind, kvEvents, kvReplay}) as the router's worker spec
`[KIND=]URL[,kv-events=ENDPOINT][,kv-replay=ENDPOINT]` (router/fleet/backends.py).
*/}}
{{- define "prefixlb.workerSpec" -}}
{{- $spec := .url -}}
{{- if .kind -}}{{- $spec = printf "%s=%s" .kind $spec -}}{{- end -}}
{{- if .kvEvents -}}{{- $spec = printf "%s,kv-events=%s" $spec .kvEvents -}}{{- end -}}
{{- if .kvReplay -}}{{- $spec = printf "%s,kv-replay=%s" $spec .kvReplay -}}{{- end -}}
{{- $spec -}}
{{- end -}}

{{/*
The worker specs of the chart's vLLM pods (a YAML list; empty unless vllm.enabled): each pod by
its stable DNS name under the headless Service, with its KV-event sockets when they are on.
*/}}
{{- define "prefixlb.vllmWorkerSpecs" -}}
{{- $specs := list -}}
{{- if .Values.vllm.enabled -}}
{{- $v := .Values.vllm -}}
{{- $name := include "prefixlb.vllmName" . -}}
{{- range $i := until (int $v.replicas) -}}
{{- $host := printf "%s-%d.%s-headless.%s.svc" $name $i $name $.Release.Namespace -}}
{{- $entry := dict "url" (printf "http://%s:%d" $host (int $v.port)) "kind" "vllm" -}}
{{- if $v.kvEvents.enabled -}}
{{- $_ := set $entry "kvEvents" (printf "tcp://%s:%d" $host (int $v.kvEvents.port)) -}}
{{- $_ := set $entry "kvReplay" (printf "tcp://%s:%d" $host (int $v.kvEvents.replayPort)) -}}
{{- end -}}
{{- $specs = append $specs (include "prefixlb.workerSpec" $entry) -}}
{{- end -}}
{{- end -}}
{{- toYaml $specs -}}
{{- end -}}

{{/*
`python -m vllm.entrypoints.openai.api_server` flags: the model, where to listen, the two flags
the router needs (prefix caching; cached_tokens in usage), the KV-event publisher and its replay
socket on every interface, the sizing knobs set, then vllm.extraArgs.
*/}}
{{- define "prefixlb.vllmArgs" -}}
{{- $v := .Values.vllm -}}
{{- if not $v.model -}}
{{- fail "vllm.model: set the Hugging Face model id or checkpoint directory the vLLM servers serve" -}}
{{- end -}}
{{- $acc := dict "args" (list (printf "--model=%s" $v.model)) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--served-model-name" "value" $v.servedModelName) -}}
{{- $_ := set $acc "args" (concat $acc.args (list "--host=0.0.0.0" (printf "--port=%d" (int $v.port))
    "--enable-prefix-caching" "--enable-prompt-tokens-details")) -}}
{{- if $v.kvEvents.enabled -}}
{{- $config := dict "enable_kv_cache_events" true "publisher" "zmq" "topic" "kv"
    "endpoint" (printf "tcp://*:%d" (int $v.kvEvents.port))
    "replay_endpoint" (printf "tcp://*:%d" (int $v.kvEvents.replayPort)) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--kv-events-config" "value" (toJson $config)) -}}
{{- end -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--max-model-len" "value" $v.maxModelLen) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--gpu-memory-utilization" "value" $v.gpuMemoryUtilization) -}}
{{- include "prefixlb.flag" (dict "acc" $acc "flag" "--tensor-parallel-size" "value" $v.tensorParallelSize) -}}
{{- toYaml (concat $acc.args $v.extraArgs) -}}
{{- end -}}
