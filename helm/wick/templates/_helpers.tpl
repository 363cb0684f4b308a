{{/* Chart name, possibly overridden. */}}
{{- define "wick.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource-name prefix: <release>-<chart>, or fullnameOverride. */}}
{{- define "wick.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "wick.modelServer.fullname" -}}
{{- printf "%s-model-server" (include "wick.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "wick.microservice.fullname" -}}
{{- printf "%s-microservice" (include "wick.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "wick.router.fullname" -}}
{{- printf "%s-router" (include "wick.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "wick.router.image" -}}
{{- include "wick.image" (dict "root" . "image" .Values.router.image "default" "wick/vllm-router") }}
{{- end }}

{{/* What the microservice calls: the router when there is one, else the model servers' Service. */}}
{{- define "wick.modelServer.endpoint" -}}
{{- if .Values.router.enabled }}
{{- printf "http://%s:%d" (include "wick.router.fullname" .) (.Values.router.service.port | int) }}
{{- else }}
{{- printf "http://%s:%d" (include "wick.modelServer.fullname" .) (.Values.modelServer.service.port | int) }}
{{- end }}
{{- end }}

{{- define "wick.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "wick.labels" -}}
helm.sh/chart: {{ include "wick.chart" . }}
app.kubernetes.io/name: {{ include "wick.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: wick
{{- end }}

{{/* Selector labels of one component: call with (dict "root" $ "component" "model-server"). */}}
{{- define "wick.selectorLabels" -}}
app.kubernetes.io/name: {{ include "wick.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "wick.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "wick.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* <registry>/<repository>:<tag> from (dict "root" $ "image" <component image values> "default" <repo>). */}}
{{- define "wick.image" -}}
{{- $root := .root }}
{{- $repository := .image.repository | default .default }}
{{- $tag := .image.tag | default $root.Values.image.tag | default $root.Chart.AppVersion }}
{{- if $root.Values.image.registry }}
{{- printf "%s/%s:%s" (trimSuffix "/" $root.Values.image.registry) $repository $tag }}
{{- else }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}
{{- end }}

{{- define "wick.modelServer.image" -}}
{{- include "wick.image" (dict "root" . "image" .Values.modelServer.image "default" (printf "wick/model-server-%s" .Values.device)) }}
{{- end }}

{{- define "wick.microservice.image" -}}
{{- include "wick.image" (dict "root" . "image" .Values.microservice.image "default" "wick/llm-microservice") }}
{{- end }}

{{/* The Secret holding HF_TOKEN / LLM_API_KEY / LLM_USVC_API_KEY, or "" when there is none. */}}
{{- define "wick.secretName" -}}
{{- if .Values.secrets.existingSecret }}
{{- .Values.secrets.existingSecret }}
{{- else if or .Values.secrets.hfToken .Values.secrets.apiKey .Values.secrets.usvcApiKey }}
{{- printf "%s-secrets" (include "wick.fullname" .) }}
{{- end }}
{{- end }}

{{/* env entries for secret keys: call with (dict "root" $ "keys" (list "HF_TOKEN" "LLM_API_KEY")).
An existing Secret may lack a key (optional); a chart-made one holds exactly the keys given. */}}
{{- define "wick.secretEnv" -}}
{{- $root := .root }}
{{- $secret := include "wick.secretName" $root }}
{{- if $secret }}
{{- $present := dict "HF_TOKEN" $root.Values.secrets.hfToken "LLM_API_KEY" $root.Values.secrets.apiKey "LLM_USVC_API_KEY" $root.Values.secrets.usvcApiKey }}
{{- range .keys }}
{{- if or $root.Values.secrets.existingSecret (get $present .) }}
- name: {{ . }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ . }}
      {{- if $root.Values.secrets.existingSecret }}
      optional: true
      {{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* A plain value for a ConfigMap: "" for null, whole numbers without a decimal point. */}}
{{- define "wick.envValue" -}}
{{- if kindIs "invalid" . -}}
{{- else if and (kindIs "float64" .) (eq (. | int64 | float64) .) -}}{{ . | int64 }}
{{- else -}}{{ . | toString }}
{{- end -}}
{{- end }}

{{/* The engine flags of a multi-node worker pod, from modelServer.config (`worker` reads flags,
not the environment; every node needs the leader's engine settings). */}}
{{- define "wick.workerArgs" -}}
{{- $flags := dict "LLM_MODEL" "--model" "LLM_DTYPE" "--dtype" "LLM_TP_SIZE" "--tensor-parallel-size" "LLM_MAX_MODEL_LEN" "--max-model-len" "LLM_MAX_NUM_SEQS" "--max-num-seqs" "LLM_MAX_NUM_BATCHED_TOKENS" "--max-num-batched-tokens" "LLM_BLOCK_SIZE" "--block-size" "LLM_KV_CACHE_MEMORY" "--kv-cache-memory" "LLM_GPU_MEMORY_UTILIZATION" "--gpu-memory-utilization" "LLM_QUANTIZATION" "--quantization" "LLM_GGUF_WEIGHTS" "--gguf-weights" "LLM_KV_CACHE_DTYPE" "--kv-cache-dtype" "LLM_NUM_THREADS" "--num-threads" }}
{{- $switches := dict "LLM_ENABLE_PREFIX_CACHING" "enable-prefix-caching" "LLM_ENABLE_CHUNKED_PREFILL" "enable-chunked-prefill" }}
- worker
- --device={{ .Values.device }}
{{- range $name, $flag := $flags }}
{{- $text := include "wick.envValue" (get $.Values.modelServer.config $name) }}
{{- if ne $text "" }}
- {{ printf "%s=%s" $flag $text | quote }}
{{- end }}
{{- end }}
{{- range $name, $flag := $switches }}
{{- $value := get $.Values.modelServer.config $name }}
{{- if not (kindIs "invalid" $value) }}
- {{ ternary (printf "--%s" $flag) (printf "--no-%s" $flag) (eq (toString $value) "true") }}
{{- end }}
{{- end }}
{{- end }}

{{/* A model-server pod spec for the LeaderWorkerSet: (dict "root" $ "role" "leader"|"worker"
"resources" <resources>). Only the leader serves HTTP and has probes (readiness: the leader's
/health, which turns 503 when a worker dies). */}}
{{- define "wick.modelServer.podSpec" -}}
{{- $root := .root }}
{{- $leader := eq .role "leader" }}
serviceAccountName: {{ include "wick.serviceAccountName" $root }}
automountServiceAccountToken: false
{{- with $root.Values.image.pullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ $root.Values.modelServer.terminationGracePeriodSeconds }}
containers:
  - name: model-server
    image: {{ include "wick.modelServer.image" $root | quote }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    {{- if $leader }}
    args: ["serve"]
    {{- else }}
    args:
      {{- include "wick.workerArgs" $root | nindent 6 }}
    {{- end }}
    ports:
      {{- if $leader }}
      - name: http
        containerPort: 8008
        protocol: TCP
      - name: rendezvous
        containerPort: {{ $root.Values.multiNode.port }}
        protocol: TCP
      {{- end }}
    envFrom:
      - configMapRef:
          name: {{ include "wick.modelServer.fullname" $root }}
    env:
      - name: MASTER_PORT
        value: {{ $root.Values.multiNode.port | quote }}
      {{- $secretEnv := include "wick.secretEnv" (dict "root" $root "keys" (list "HF_TOKEN" "LLM_API_KEY")) }}
      {{- if $secretEnv }}
      {{- $secretEnv | nindent 6 }}
      {{- end }}
    {{- if $leader }}
    startupProbe:
      httpGet:
        path: /health
        port: http
      {{- toYaml $root.Values.modelServer.startupProbe | nindent 6 }}
    readinessProbe:
      httpGet:
        path: /health
        port: http
      {{- toYaml $root.Values.modelServer.readinessProbe | nindent 6 }}
    livenessProbe:
      httpGet:
        path: /health
        port: http
      {{- toYaml $root.Values.modelServer.livenessProbe | nindent 6 }}
    {{- end }}
    resources:
      {{- toYaml .resources | nindent 6 }}
    securityContext:
      {{- toYaml $root.Values.containerSecurityContext | nindent 6 }}
    volumeMounts:
      - name: model-cache
        mountPath: {{ $root.Values.modelCache.mountPath }}
      - name: tmp
        mountPath: /tmp
      - name: shm
        mountPath: /dev/shm
volumes:
  - name: model-cache
    {{- if $root.Values.modelCache.persistence.enabled }}
    persistentVolumeClaim:
      claimName: {{ $root.Values.modelCache.persistence.existingClaim | default (printf "%s-model-cache" (include "wick.fullname" $root)) }}
    {{- else }}
    emptyDir:
      sizeLimit: {{ $root.Values.modelCache.emptyDir.sizeLimit }}
    {{- end }}
  - name: tmp
    emptyDir:
      sizeLimit: {{ $root.Values.modelServer.tmpSize }}
  - name: shm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $root.Values.modelServer.shmSize }}
{{- with $root.Values.modelServer.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.modelServer.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.modelServer.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
