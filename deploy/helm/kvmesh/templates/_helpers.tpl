{{/* The prefix of every name: the release's name where it holds the chart's ("kvmesh",
"kvmesh-prod"), else "<release>-kvmesh". */}}
{{/* 40 characters at most: "<name>-redis" names a StatefulSet, whose pods' revision label
("<name>-redis-<10-character hash>") must fit in 63. */}}
{{- define "kvmesh.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Every object's labels (pod selectors use "app" alone, as deploy/kustomize/base does). */}}
{{- define "kvmesh.labels" -}}
app.kubernetes.io/part-of: kvmesh
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvmesh.image" -}}
{{- printf "%s:%s" .image.repository (.image.tag | default .appVersion) -}}
{{- end -}}

{{/* The shared tier's URL the workers get ("" for none). */}}
{{- define "kvmesh.remoteUrl" -}}
{{- if and .Values.redis.enabled .Values.redis.url -}}
{{- fail "redis.url names your own shared tier: set redis.enabled=false with it (enabled deploys the chart's Valkey)" -}}
{{- end -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://kvmesh:$(REDIS_PASSWORD)@%s-redis:6379/0" (include "kvmesh.fullname" .) -}}
{{- else -}}
{{- .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{/* Whether the Prometheus Operator's kinds are rendered. */}}
{{- define "kvmesh.monitoring" -}}
{{- $m := .Values.monitoring.enabled -}}
{{- if or (eq (toString $m) "true") (and (eq (toString $m) "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) -}}
true
{{- end -}}
{{- end -}}
