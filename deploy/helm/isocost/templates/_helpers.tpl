{{/*
The data-plane mode, "gateway" or "picker"; anything else stops the render.
*/}}
{{- define "isocost.mode" -}}
{{- if not (has .Values.mode (list "gateway" "picker")) -}}
{{- fail (printf "mode must be gateway or picker, not %q" (toString .Values.mode)) -}}
{{- end -}}
{{- .Values.mode -}}
{{- end -}}

{{- define "isocost.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
<release>-isocost, or just <release> when it already names the chart; 63 characters at
most (a DNS label).
*/}}
{{- define "isocost.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "isocost.selectorLabels" -}}
app.kubernetes.io/name: {{ include "isocost.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/*
The mode is a label, not a selector: a selector cannot change, the mode can.
*/}}
{{- define "isocost.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "isocost.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ include "isocost.mode" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/*
The autoscaler's Pods: labels of their own, so that the gateways' Services select none.
*/}}
{{- define "isocost.autoscalerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "isocost.name" . }}-autoscaler
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "isocost.autoscalerLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "isocost.autoscalerSelectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/component: autoscaler
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "isocost.serviceAccountName" -}}
{{- if .Values.rbac.create -}}
{{- include "isocost.fullname" . -}}
{{- else -}}
{{- .Values.rbac.serviceAccountName | default "default" -}}
{{- end -}}
{{- end -}}

{{/*
The port Prometheus scrapes: the gateway serves /metrics on its one port, the picker on
its own.
*/}}
{{- define "isocost.metricsPort" -}}
{{- if eq (include "isocost.mode" .) "gateway" -}}
{{- .Values.gateway.port | int -}}
{{- else -}}
{{- .Values.picker.metricsPort | int -}}
{{- end -}}
{{- end -}}

{{/*
Whether this release renders an InferencePool: picker mode with inferencePool.enabled.
*/}}
{{- define "isocost.rendersPool" -}}
{{- if and (eq (include "isocost.mode" .) "picker") .Values.inferencePool.enabled -}}true{{- end -}}
{{- end -}}

{{/*
The config file as rendered: .Values.config, with discovery.kubernetes.namespace
defaulting to the release's namespace, and auth.admin_token_env set when the admin token
comes from a Secret (gateway mode). With the release's InferencePool, discovery follows
that pool (inference_pool: its name) in place of the selector and port it is made from,
so the picker reads the very object the Gateway routes to.
*/}}
{{- define "isocost.config" -}}
{{- $config := deepCopy (.Values.config | default dict) -}}
{{- $kube := dig "discovery" "kubernetes" dict $config -}}
{{- if $kube -}}
{{- $_ := set $kube "namespace" ($kube.namespace | default .Release.Namespace) -}}
{{- if include "isocost.rendersPool" . -}}
{{- range $key := list "service" "label_selector" "port" "port_name" -}}
{{- $_ := unset $kube $key -}}
{{- end -}}
{{- $_ := set $kube "inference_pool" (include "isocost.fullname" .) -}}
{{- end -}}
{{- end -}}
{{- if .Values.adminToken.existingSecret -}}
{{- if ne (include "isocost.mode" .) "gateway" -}}
{{- fail "adminToken: only the gateway (mode=gateway) has an admin API" -}}
{{- end -}}
{{- $auth := get $config "auth" | default dict -}}
{{- $_ := set $auth "admin_token_env" "ISOCOST_ADMIN_TOKEN" -}}
{{- $_ := set $config "auth" $auth -}}
{{- end -}}
{{- with .Values.upstreamTls -}}
{{- if .existingSecret -}}
{{- if ne (empty .certKey) (empty .keyKey) -}}
{{- fail "upstreamTls: give certKey and keyKey together (the client certificate and its key)" -}}
{{- end -}}
{{- $tls := dict "ca_file" (printf "/etc/isocost-tls/%s" .caKey) -}}
{{- if .certKey -}}
{{- $_ := set $tls "cert_file" (printf "/etc/isocost-tls/%s" .certKey) -}}
{{- $_ := set $tls "key_file" (printf "/etc/isocost-tls/%s" .keyKey) -}}
{{- end -}}
{{- $_ := set $config "upstream_tls" $tls -}}
{{- end -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/*
The rendered config's discovery.kubernetes section as YAML ("{}" without one).
*/}}
{{- define "isocost.kubeDiscovery" -}}
{{- toYaml (dig "discovery" "kubernetes" dict (include "isocost.config" . | fromYaml)) -}}
{{- end -}}

{{/*
The model servers the InferencePool selects, as .Values.config names them (before the
rendered config points discovery at the pool): discovery.kubernetes as YAML ("{}" without).
*/}}
{{- define "isocost.poolMembers" -}}
{{- toYaml (dig "discovery" "kubernetes" dict (.Values.config | default dict)) -}}
{{- end -}}

{{/*
The InferencePool's matchLabels, from config.discovery.kubernetes.label_selector
("a=b,c=d").
*/}}
{{- define "isocost.poolMatchLabels" -}}
{{- $kube := include "isocost.poolMembers" . | fromYaml -}}
{{- if not $kube.label_selector -}}
{{- fail "inferencePool.enabled needs config.discovery.kubernetes.label_selector: the pool's selector is made from it" -}}
{{- end -}}
{{- $labels := dict -}}
{{- range $term := splitList "," $kube.label_selector -}}
{{- if not (regexMatch "^\\s*[A-Za-z0-9][-A-Za-z0-9_./]*\\s*==?\\s*[-A-Za-z0-9_.]*\\s*$" $term) -}}
{{- fail (printf "inferencePool.enabled: label_selector term %q is not key=value (an InferencePool takes matchLabels only)" $term) -}}
{{- end -}}
{{- $kv := regexSplit "==?" $term 2 -}}
{{- $_ := set $labels (trim (index $kv 0)) (trim (index $kv 1)) -}}
{{- end -}}
{{- toYaml $labels -}}
{{- end -}}
