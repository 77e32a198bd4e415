{{- /*
The agent's DaemonSet, in device-plugin mode (templates/daemonset.yaml) or DRA mode
(templates/dra.yaml): (dict "root" . "dra" bool). deploy/daemonset/daemonset.yaml explains
every field; deploy/dra/daemonset.yaml lists what the DRA one changes. Ports, host paths and
the shim's location follow the (merged) node config, so they cannot disagree with what the
agent reads.
*/ -}}
{{- define "gpufrac.daemonset" -}}
{{- $root := .root }}
{{- $dra := .dra }}
{{- $cfg := include "gpufrac.config" $root | fromYaml }}
{{- $port := int $cfg.metrics.port }}
{{- $stateDir := $cfg.paths.stateDir }}
{{- $kubeletDir := $cfg.paths.kubeletDir }}
{{- $shim := $cfg.paths.shimHostPath }}
{{- $shimTmp := printf "%s/.%s.new" (dir $shim) (base $shim) }}
{{- $image := include "gpufrac.image" $root }}
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: gpufrac-agent{{ if $dra }}-dra{{ end }}
  namespace: {{ $root.Values.namespace.name }}
  labels:
    {{- include "gpufrac.labels" (dict "root" $root "component" "agent") | nindent 4 }}
    {{- if $dra }}
    gpufrac.dev/mode: dra
    {{- end }}
spec:
  selector:
    matchLabels:
      app.kubernetes.io/name: gpufrac
      app.kubernetes.io/component: agent
      {{- if $dra }}
      gpufrac.dev/mode: dra
      {{- end }}
  updateStrategy:
    type: RollingUpdate
    rollingUpdate:
      maxUnavailable: 1
  template:
    metadata:
      labels:
        {{- include "gpufrac.labels" (dict "root" $root "component" "agent") | nindent 8 }}
        {{- if $dra }}
        gpufrac.dev/mode: dra
        {{- end }}
      annotations:
        prometheus.io/scrape: "true"
        prometheus.io/port: {{ $port | quote }}
        prometheus.io/path: /metrics
        {{- with $root.Values.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: gpufrac-agent
      {{- with $root.Values.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      hostPID: true
      {{- $nodeSelector := deepCopy ($root.Values.nodeSelector | default dict) }}
      {{- if $dra }}
      {{- $_ := set $nodeSelector "gpufrac.dev/mode" "dra" }}
      {{- end }}
      {{- with $nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with include "gpufrac.affinity" (dict "root" $root "dra" $dra) | fromYaml }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      {{- with $root.Values.image.pullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      terminationGracePeriodSeconds: 30
      securityContext:
        seccompProfile:
          type: RuntimeDefault
      initContainers:
        - name: install-shim
          image: {{ $image }}
          {{- with $root.Values.image.pullPolicy }}
          imagePullPolicy: {{ . }}
          {{- end }}
          command:
            - /bin/sh
            - -c
            - >-
              install -D -m 0755 /usr/lib/gpufrac/libmemguard.so {{ $shimTmp }} &&
              mv -f {{ $shimTmp }} {{ $shim }}
          securityContext:
            runAsUser: 0
            runAsNonRoot: false
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities:
              drop: [ALL]
          resources:
            {{- toYaml $root.Values.resources.installShim | nindent 12 }}
          volumeMounts:
            - name: state
              mountPath: {{ $stateDir }}
      containers:
        - name: agent
          image: {{ $image }}
          {{- with $root.Values.image.pullPolicy }}
          imagePullPolicy: {{ . }}
          {{- end }}
          command: [gpufrac]
          {{- if $dra }}
          args: [agent, --config, /etc/gpufrac/config.yaml, --config-overlay, /etc/gpufrac-dra/config.yaml]
          {{- else }}
          args: [agent, --config, /etc/gpufrac/config.yaml]
          {{- end }}
          env:
            - name: NODE_NAME
              valueFrom:
                fieldRef:
                  fieldPath: spec.nodeName
            - name: NVIDIA_VISIBLE_DEVICES
              value: all
            - name: NVIDIA_DRIVER_CAPABILITIES
              value: compute,utility
          ports:
            - name: metrics
              containerPort: {{ $port }}
              protocol: TCP
          startupProbe:
            httpGet:
              path: /healthz
              port: metrics
            periodSeconds: 5
            failureThreshold: 60
          livenessProbe:
            httpGet:
              path: /healthz
              port: metrics
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 6
          readinessProbe:
            httpGet:
              path: /readyz
              port: metrics
            periodSeconds: 5
            timeoutSeconds: 3
            failureThreshold: 3
          resources:
            {{- toYaml $root.Values.resources.agent | nindent 12 }}
          securityContext:
            privileged: false
            runAsUser: 0
            runAsNonRoot: false
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities:
              drop: [ALL]
              add:
                {{- /* Swap (the driver's checkpoint API) and /proc reads of other users' processes. */}}
                - SYS_PTRACE
                {{- /* Evicting burst holders and idle workloads signals other users' processes. */}}
                - KILL
          volumeMounts:
            - name: config
              mountPath: /etc/gpufrac
              readOnly: true
            {{- if $dra }}
            - name: config-dra
              mountPath: /etc/gpufrac-dra
              readOnly: true
            {{- end }}
            - name: state
              mountPath: {{ $stateDir }}
            {{- if $dra }}
            - name: dra-plugin
              mountPath: {{ $kubeletDir }}/plugins/{{ $cfg.dra.driverName }}
            - name: plugins-registry
              mountPath: {{ $kubeletDir }}/plugins_registry
            - name: cdi
              mountPath: {{ $cfg.dra.cdiSpecDir }}
            {{- else }}
            - name: device-plugins
              mountPath: {{ $kubeletDir }}/device-plugins
            {{- end }}
            - name: pod-resources
              mountPath: {{ $kubeletDir }}/pod-resources
            - name: run
              mountPath: {{ dir $cfg.statusSocket }}
            - name: tmp
              mountPath: /tmp
      volumes:
        - name: config
          configMap:
            name: {{ include "gpufrac.configName" $root }}
        {{- if $dra }}
        - name: config-dra
          configMap:
            name: {{ include "gpufrac.draConfigName" $root }}
        {{- end }}
        - name: state
          hostPath:
            path: {{ $stateDir }}
            type: DirectoryOrCreate
        {{- if $dra }}
        - name: dra-plugin
          hostPath:
            path: {{ $kubeletDir }}/plugins/{{ $cfg.dra.driverName }}
            type: DirectoryOrCreate
        - name: plugins-registry
          hostPath:
            path: {{ $kubeletDir }}/plugins_registry
            type: Directory
        - name: cdi
          hostPath:
            path: {{ $cfg.dra.cdiSpecDir }}
            type: DirectoryOrCreate
        {{- else }}
        - name: device-plugins
          hostPath:
            path: {{ $kubeletDir }}/device-plugins
            type: Directory
        {{- end }}
        - name: pod-resources
          hostPath:
            path: {{ $kubeletDir }}/pod-resources
            type: Directory
        - name: run
          emptyDir:
            medium: Memory
            sizeLimit: 16Mi
        - name: tmp
          emptyDir:
            sizeLimit: 256Mi
{{- end }}
