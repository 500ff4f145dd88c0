{{/*
Names, labels and the values every template shares.
*/}}

{{- define "prefixlb.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release-scoped base name; components append -router, -worker, -redis. */}}
{{- define "prefixlb.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "prefixlb.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "prefixlb.labels" -}}
helm.sh/chart: {{ include "prefixlb.chart" . }}
app.kubernetes.io/name: {{ include "prefixlb.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: prefixlb
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "router"). */}}
{{- define "prefixlb.selectorLabels" -}}
app.kubernetes.io/name: {{ include "prefixlb.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "prefixlb.componentLabels" -}}
{{ include "prefixlb.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "prefixlb.routerName" -}}{{ include "prefixlb.fullname" . }}-router{{- end -}}
{{- define "prefixlb.workerName" -}}{{ include "prefixlb.fullname" . }}-worker{{- end -}}
{{- define "prefixlb.redisName" -}}{{ include "prefixlb.fullname" . }}-redis{{- end -}}
{{- define "prefixlb.vllmName" -}}{{ include "prefixlb.fullname" . }}-vllm{{- end -}}

{{- define "prefixlb.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "prefixlb.routerName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* image reference: call with (dict "image" .Values.router.image "ctx" $). */}}
{{- define "prefixlb.image" -}}
{{- $tag := default .ctx.Chart.AppVersion .image.tag -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the bundled Redis's passwords (redis.auth). */}}
{{- define "prefixlb.redisSecretName" -}}
{{- default (include "prefixlb.redisName" .) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{/*
The environment that gives a router or a worker its Redis URL (call with (dict "ctx" $ "role"
"router")): for the bundled Redis, the role's password from the Secret as REDIS_PASSWORD, then
the URL with it (the kubelet expands $(REDIS_PASSWORD) from the variable defined just before, so
the password is in no pod spec and no argument); for an external Redis whose URL is in a Secret,
that URL. Nothing for redis.url (a flag) or no Redis.
*/}}
{{- define "prefixlb.redisEnv" -}}
{{- $v := .ctx.Values.redis -}}
{{- $var := printf "PREFIXLB_%s_REDIS" (upper .role) -}}
{{- if $v.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "prefixlb.redisSecretName" .ctx }}
      key: {{ ternary (index $v.auth (printf "%sPasswordKey" .role)) $v.auth.passwordKey $v.auth.acl }}
- name: {{ $var }}
  value: {{ printf "redis://%s:$(REDIS_PASSWORD)@%s:%d/0" (ternary .role "" $v.auth.acl) (include "prefixlb.redisName" .ctx) (int $v.port) | quote }}
{{- else if $v.existingSecret }}
- name: {{ $var }}
  valueFrom:
    secretKeyRef:
      name: {{ $v.existingSecret }}
      key: {{ $v.existingSecretKey }}
{{- end }}
{{- end -}}

{{/*
The ACL rules of the bundled Redis's `router` and `worker` users (redis.auth.acl), without their
passwords: each user may run only the commands its code sends (router/state.py,
worker/server/publisher.py), each on only the keys it sends them to (protocol/keys.py), by
Redis 7 selectors "(keys commands)". Workers write their registration, load report and heartbeat
and append KV events; they cannot read, drain, change the shared config or touch the index
snapshot. Routers read registrations, load reports and the event stream, prune the heartbeat set,
and own the snapshot, the shared config and the drains. CLIENT SETINFO is the name redis-py gives
its connections. tests/unit/test_helm_redis_auth.py runs the real router and worker code against
a redis-server with these rules, and the commands each role must be refused.
*/}}
{{- define "prefixlb.redisAclRules" -}}
{{- $p := .Values.redis.keyPrefix -}}
router: {{ printf "resetchannels -@all +multi +exec +discard +ping +client|setinfo %%R~%sworker:* %%R~%sload:* +mget (~%sworkers +zrange +zrem) (%%R~%skv_events +xread +xinfo|stream) (~%sindex_snapshot +get +set) (~%sconfig +hgetall +hincrby +hset) (~%sdrains +hgetall +hset +hdel +expire)" $p $p $p $p $p $p $p | quote }}
worker: {{ printf "resetchannels -@all +ping +client|setinfo %%W~%sworker:* %%W~%sload:* +set +del (%%W~%sworkers +zadd +zrem) (%%W~%skv_events +xadd)" $p $p $p $p | quote }}
{{- end -}}

{{/* The Secret holding the fleet signing secret (redis.signing). */}}
{{- define "prefixlb.signingSecretName" -}}
{{- default (printf "%s-signing" (include "prefixlb.fullname" .)) .Values.redis.signing.existingSecret -}}
{{- end -}}

{{/* True (non-empty) when Redis messages are signed: redis.signing.enabled and some Redis. */}}
{{- define "prefixlb.signing" -}}
{{- if and .Values.redis.signing.enabled (include "prefixlb.hasRedis" .) -}}true{{- end -}}
{{- end -}}

{{/* True (non-empty) when routers and workers talk to some Redis. */}}
{{- define "prefixlb.hasRedis" -}}
{{- if or .Values.redis.enabled .Values.redis.url .Values.redis.existingSecret -}}true{{- end -}}
{{- end -}}

{{- define "prefixlb.adminTokenSecretName" -}}
{{- default (printf "%s-admin-token" (include "prefixlb.fullname" .)) .Values.router.adminToken.existingSecret -}}
{{- end -}}

{{/* The Secret the chart renders for API keys (secret-api-keys.yaml) when it holds any. */}}
{{- define "prefixlb.apiKeysSecretName" -}}
{{- printf "%s-api-keys" (include "prefixlb.fullname" .) -}}
{{- end -}}

{{/* Name of the Secret holding the clients' API keys; empty when the routers are open. */}}
{{- define "prefixlb.routerApiKeysSecretName" -}}
{{- $k := .Values.router.apiKeys -}}
{{- if $k.existingSecret -}}{{ $k.existingSecret }}{{- else if $k.keys -}}{{ include "prefixlb.apiKeysSecretName" . }}{{- end -}}
{{- end -}}

{{/* Name of the Secret holding the router-to-worker key; empty when worker.apiKey is off. */}}
{{- define "prefixlb.workerApiKeySecretName" -}}
{{- $k := .Values.worker.apiKey -}}
{{- if $k.enabled -}}{{ default (include "prefixlb.apiKeysSecretName" .) $k.existingSecret }}{{- end -}}
{{- end -}}

{{/* The restricted container securityContext shared by every prefixlb container. */}}
{{- define "prefixlb.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/*
Pod-spec fields an operator adds to the router or worker pods (the component's values as the
context): priority and runtime class, init containers. Extra volumes and mounts are added to the
lists the templates already have.
*/}}
{{- define "prefixlb.podExtras" -}}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .initContainers }}
initContainers:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
