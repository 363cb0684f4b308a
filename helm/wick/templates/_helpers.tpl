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
