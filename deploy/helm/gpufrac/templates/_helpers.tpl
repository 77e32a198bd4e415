{{/*
The labels every object carries: the same app.kubernetes.io/* set as the kustomize
base (no helm.sh/chart or managed-by), so both installs produce identical objects
and selectors; commonLabels adds the operator's own.
*/}}
{{- define "gpufrac.labels" -}}
app.kubernetes.io/name: gpufrac
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
app.kubernetes.io/part-of: gpufrac
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The node config as a dict: the shipped file with .Values.config merged over it. */}}
{{- define "gpufrac.config" -}}
{{- $cfg := .Files.Get "files/config.yaml" | fromYaml -}}
{{- toYaml (mergeOverwrite $cfg (deepCopy .Values.config)) -}}
{{- end }}

{{/* The ConfigMap's config.yaml: the shipped file verbatim (comments and all) unless overridden. */}}
{{- define "gpufrac.configText" -}}
{{- if .Values.config -}}
{{- include "gpufrac.config" . }}
{{ else -}}
{{- .Files.Get "files/config.yaml" -}}
{{- end -}}
{{- end }}

{{/*
gpufrac-config-<hash>, computed the way kustomize's configMapGenerator does
(sha256 of the JSON of kind, an empty name and data; 10 hex digits with 0,1,3,a,e
mapped to g,h,k,m,t), so the name matches the kustomize base for the same content
and a changed config rolls the agents.
*/}}
{{- define "gpufrac.configName" -}}
{{- $enc := dict "data" (dict "config.yaml" (include "gpufrac.configText" .)) "kind" "ConfigMap" "name" "" | toJson -}}
{{- $hash := $enc | sha256sum | trunc 10 | replace "0" "g" | replace "1" "h" | replace "3" "k" | replace "a" "m" | replace "e" "t" -}}
gpufrac-config-{{ $hash }}
{{- end }}

{{- define "gpufrac.image" -}}
{{- $repo := required "image.repository is required: the registry path you pushed the agent image to (see deploy/daemonset/Dockerfile), e.g. --set image.repository=registry.example.com/gpufrac/agent" .Values.image.repository -}}
{{- if .Values.image.digest -}}
{{ $repo }}@{{ .Values.image.digest }}
{{- else -}}
{{ $repo }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end }}
